"""Generalised advantage estimation (Schulman et al. 2016) over the response positions, and
advantage whitening, with trlX's semantics.

Layout: `[B, T-1]` tensors, `mask` = `LOSS_MASK`, one contiguous response span per row (prompt
before it, right padding after it). The value after a row's last response token is 0 (the
episode ends there), so padding never leaks into an advantage.

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
    steps = values.shape[1]
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        advantages[:, t] = last
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
