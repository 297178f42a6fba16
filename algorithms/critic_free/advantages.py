"""Advantage estimators of the critic-free family: no value model, the other samples are the
baseline. Pure torch, unit-tested against hand-computed values; registered by name
(`algorithms.core.registry`) as `grpo`, `rloo` and `reinforce_pp`.

Rows come in groups: the `n` responses to one prompt are rows `g*n .. g*n+n-1`. `valid` `[B]`
(0 for a sample dropped for a non-finite score) keeps a row out of its group's statistics.

    GRPO (Shao et al. 2024)     A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    Dr. GRPO (Liu et al. 2025)  A_i =  r_i - mean(r_group)                  (scale_by_std=False)
    RLOO (Ahmadian et al. 2024) A_i =  r_i - mean(r_j, j != i in the group)
    REINFORCE++ (Hu 2025)       A_t = whiten over the batch of sum_{s >= t} r_s (per-token rewards,
                                      the KL penalty on every token and the score on the last)

The first three give one advantage per sequence, broadcast over its response tokens
(`per_token`); REINFORCE++ is per token already. Where the KL goes in the reward (`kl_coef`),
GRPO's and RLOO's `r_i` is the score less `kl_coef` x the response's summed k1. On-policy
distillation's teacher term, alone (`opd`) or added, is `algorithms.core.teacher`'s.
"""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.kl_estimators import kl_terms
from algorithms.core.masked import whiten
from algorithms.core.registry import register_adv_est
from algorithms.core.rewards import kl_penalized_rewards


def groups_of(scores: torch.Tensor, n: int) -> torch.Tensor:
    """`[B]` -> `[B / n, n]`; a clear error if `B` is not whole groups."""
    if n < 1 or scores.numel() % n:
        raise ValueError(f"{scores.numel()} samples do not form groups of {n} responses per prompt; "
                         "each prompt needs exactly rollout.n_samples responses")
    return scores.reshape(-1, n)


def _valid(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(scores) if valid is None else valid.to(scores.dtype)


def grpo_advantages(scores: torch.Tensor, n: int, scale_by_std: bool = True, eps: float = 1e-6,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence GRPO advantages `[B]`: centred on the group mean and, with `scale_by_std`,
    divided by the group's (unbiased) std plus `eps`. A group whose rewards are all equal gets 0."""
    r, v = groups_of(scores.float(), n), groups_of(_valid(scores.float(), valid), n)
    count = v.sum(1, keepdim=True)
    mean = (r * v).sum(1, keepdim=True) / count.clamp(min=1.0)
    centred = (r - mean) * v
    if scale_by_std:
        std = torch.sqrt((centred ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1.0))
        centred = centred / (std + eps)
    return centred.reshape(-1)


def varied_groups(scores: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[B / n]` bool: the groups whose valid rewards are not all equal, the ones DAPO's dynamic
    sampling keeps (a group whose rewards are all equal has no advantage to learn from); every
    group when n is 1, as veRL's filter."""
    r, v = groups_of(scores.float(), n), groups_of(_valid(scores.float(), valid), n) > 0
    if n == 1:
        return torch.ones(r.shape[0], dtype=torch.bool)
    high = torch.where(v, r, float("-inf")).max(1).values
    low = torch.where(v, r, float("inf")).min(1).values
    return (v.sum(1) >= 2) & (high > low)


def rloo_advantages(scores: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence RLOO advantages `[B]`: each reward minus the mean of the other valid rewards
    of its group (0 for a sample with no valid peer)."""
    if n < 2:
        raise ValueError("RLOO's leave-one-out baseline needs at least 2 responses per prompt; "
                         "set rollout.n_samples >= 2")
    r, v = groups_of(scores.float(), n), groups_of(_valid(scores.float(), valid), n)
    total, count = (r * v).sum(1, keepdim=True), v.sum(1, keepdim=True)
    others = count - v
    baseline = (total - r * v) / others.clamp(min=1.0)
    return ((r - baseline) * v * (others > 0)).reshape(-1)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence advantages `[B]` on every response position of `mask` `[B, T-1]`."""
    return advantages.to(mask.dtype)[:, None] * mask


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """`G_t = r_t + gamma * G_{t+1}` over each row's response positions `[B, T-1]` (0 elsewhere);
    `t + 1` is the next model token: a multi-turn episode's observations (holes in the mask) pass
    the return on, undiscounted."""
    m = mask.to(rewards.dtype)
    out, running = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t] > 0, rewards[:, t] * m[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            min_std: float = 0.0) -> torch.Tensor:
    """REINFORCE++ advantages `[B, T-1]`: returns-to-go of the per-token rewards, whitened over
    every response token of the batch (the global batch normalisation that replaces a critic)."""
    return whiten(returns_to_go(token_rewards, mask, gamma), mask, min_std=min_std)


def _kl_penalized_scores(inp: AdvantageInputs) -> torch.Tensor:
    """The sequence's score less `kl_coef` x its summed k1 where the KL goes in the reward."""
    if not inp.kl_coef:
        return inp.scores
    if inp.ref_logprobs is None:
        raise ValueError("a KL penalty in the reward (kl_coef > 0) needs the reference's log-probs; "
                         "set critic_free.kl_in to none or loss, or start the reference")
    return inp.scores - inp.kl_coef * (kl_terms(inp.logprobs, inp.ref_logprobs, "k1") * inp.mask).sum(1)


@register_adv_est("grpo")
def grpo(inp: AdvantageInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GRPO's (Dr. GRPO's without `critic_free.scale_by_std`) per-token advantages; no returns."""
    scores = _kl_penalized_scores(inp)
    return per_token(grpo_advantages(scores, inp.n, inp.critic_free.scale_by_std, valid=inp.valid), inp.mask), None


@register_adv_est("rloo")
def rloo(inp: AdvantageInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RLOO's per-token advantages; no returns."""
    return per_token(rloo_advantages(_kl_penalized_scores(inp), inp.n, valid=inp.valid), inp.mask), None


@register_adv_est("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """REINFORCE++'s advantages: the KL-penalised per-token rewards (no reference: no penalty),
    returns-to-go with `ppo.gamma`, whitened with the floor `ppo.whiten_min_std`; no returns."""
    reference = inp.logprobs if inp.ref_logprobs is None else inp.ref_logprobs
    rewards = kl_penalized_rewards(inp.logprobs, reference, inp.mask, inp.scores, inp.kl_coef)
    return reinforce_pp_advantages(rewards, inp.mask, inp.ppo.gamma, inp.ppo.whiten_min_std), None
