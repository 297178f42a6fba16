"""Advantage estimators of the critic-free family: no value model, the other samples are the
baseline. Pure torch, unit-tested against hand-computed values.

Rows come in groups: the `n` responses to one prompt are rows `g*n .. g*n+n-1`. `valid` `[B]`
(0 for a sample dropped for a non-finite score) keeps a row out of its group's statistics.

    GRPO (Shao et al. 2024)     A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    Dr. GRPO (Liu et al. 2025)  A_i =  r_i - mean(r_group)                  (scale_by_std=False)
    RLOO (Ahmadian et al. 2024) A_i =  r_i - mean(r_j, j != i in the group)
    REINFORCE++ (Hu 2025)       A_t = whiten over the batch of sum_{s >= t} r_s (per-token rewards,
                                      the KL penalty on every token and the score on the last)
    On-policy distillation      A_t = c (log pi_teacher(y_t) - log pi_student(y_t)): the negative
      (Agarwal et al. 2024;           per-token reverse KL of the sampled token, not discounted,
       Lu and Thinking Machines       not normalised (`opd` alone with c = 1; added to any of the
       2025)                          above with c = `distill.teacher_coef`)

The first three give one advantage per sequence, broadcast over its response tokens
(`per_token`); REINFORCE++ is per token already.
"""
from __future__ import annotations

import torch

from algorithms.ppo.gae import whiten


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


def teacher_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """`[B, T-1]`: `coef` x (teacher's - student's log-prob of each sampled token) on the response
    positions of `mask`, 0 elsewhere. Positive where the teacher finds the student's token likelier
    than the student does: minimising the reverse KL, one sampled token at a time."""
    return coef * (teacher.float() - student.float()) * mask.to(torch.float32)


def teacher_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`distill/reverse_kl`: the mean over response tokens of student - teacher log-prob of the
    sampled token (the k1 estimate of KL(student || teacher), what on-policy distillation lowers);
    `distill/teacher_logprob`: the teacher's mean log-prob of the student's tokens."""
    m = mask.float()
    tokens = m.sum().clamp(min=1.0)
    return {"distill/reverse_kl": float(((student.float() - teacher.float()) * m).sum() / tokens),
            "distill/teacher_logprob": float((teacher.float() * m).sum() / tokens)}


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
