"""Generalised advantage estimation (Schulman et al. 2016) over the response positions, and
advantage whitening, with trlX's semantics.

Layout: `[B, T-1]` tensors, `mask` = `LOSS_MASK`: a row's response positions (prompt before
them, right padding after). A multi-turn episode's mask has holes, its observations: the
recursion runs over the model's tokens only, skipping them (the next value of a turn's last token
is the first value of the next turn), so a reward at the episode's end reaches every turn. The
value after a row's last response token is 0 (the episode ends there), so padding never leaks
into an advantage.

    delta[t] = r[t] + gamma * V[t+1] - V[t]
    A[t]     = delta[t] + gamma * lam * A[t+1]
    returns  = A + V            (computed before whitening, as trlX)
"""
from __future__ import annotations

import torch

from algorithms.ppo.masked import masked_mean, masked_var


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


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
           min_std: float = 0.0) -> torch.Tensor:
    """`(x - mean) / max(sqrt(var + eps), min_std)` over the masked positions (unbiased variance,
    as `torch.var_mean`); with `shift_mean=False` the mean is added back (trlX's option, used for
    rewards). `min_std` keeps a nearly uniform batch (a policy that is nearly always right: only
    the critic's noise is left) from being blown up to unit variance. Positions outside the mask
    are 0."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    std = torch.sqrt(masked_var(x, m) + eps).clamp(min=min_std)
    whitened = (x - mean) / std
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m
