"""Generalised advantage estimation (Schulman et al. 2016) over the response positions, with
trlX's semantics, and PPO's advantage estimator `gae` (`algorithms.core.registry`).

Layout: `[B, T-1]` tensors, `mask` = `LOSS_MASK`: a row's response positions (prompt before
them, right padding after). A multi-turn episode's mask has holes, its observations: the
recursion runs over the model's tokens only, skipping them (the next value of a turn's last token
is the first value of the next turn), so a reward at the episode's end reaches every turn. The
value after a row's last response token is 0 (the episode ends there), so padding never leaks
into an advantage.

    delta[t] = r[t] + gamma * V[t+1] - V[t]
    A[t]     = delta[t] + gamma * lam * A[t+1]
    returns  = A + V            (computed before whitening, as trlX)

The estimator: the KL-penalised per-token rewards (`algorithms.core.rewards`), GAE, then
whitening over the batch (`ppo.whiten_advantages`, floor `ppo.whiten_min_std`).
"""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.masked import whiten
from algorithms.core.registry import register_adv_est
from algorithms.core.rewards import kl_penalized_rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns `[B, T-1]`, both 0 outside the mask."""
    m = mask.to(values.dtype)
    values = values * m
    rewards = rewards * m
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(last)  # of the next model token (0 after the last)
    for t in reversed(range(values.shape[1])):
        here = m[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(here, delta + gamma * lam * last, last)  # an observation passes it on
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = last * m[:, t]
    returns = (advantages + values) * m
    return advantages.detach(), returns.detach()


@register_adv_est("gae")
def gae_estimator(inp: AdvantageInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """PPO's (advantages, returns): `kl_coef` x k1 penalty on every token and the score on the
    last, GAE with `ppo.gamma` and `ppo.lam`, advantages whitened if `ppo.whiten_advantages`."""
    if inp.values is None or inp.ref_logprobs is None:
        raise ValueError("the gae advantage estimator needs the critic's values and the reference's log-probs; "
                         "run it with a critic and a reference (python -m xray.train ppo)")
    ppo = inp.ppo
    rewards = kl_penalized_rewards(inp.logprobs, inp.ref_logprobs, inp.mask, inp.scores, inp.kl_coef)
    advantages, returns = gae(rewards, inp.values, inp.mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, inp.mask, min_std=ppo.whiten_min_std)
    return advantages, returns
