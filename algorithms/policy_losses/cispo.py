"""CISPO's policy loss (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585), registered as `cispo`
(`algorithms/policy_losses`, one registered loss per file): REINFORCE with the importance weight
clipped and detached, so a clipped token still gets its gradient (only its weight is bounded),
where PPO's clip drops it.

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20))
    loss  = agg( -sg(clip(ratio, 1 - cliprange, 1 + cliprange_high)) * A * logprobs )

As veRL's `compute_policy_loss_cispo` (`verl/trainer/ppo/core_algos.py`), whose value and
gradient this matches: both ends clipped, the log-ratio clamped to [-20, 20], aggregated by
`ppo.loss_agg_mode` (the paper's is `token-mean`). The paper bounds the weight above only:
`cliprange` >= 1 leaves it no lower bound. `clipfrac` is the share of response tokens whose weight
was clipped; `approx_kl` and `ratio` are the token-level statistics every policy loss reports.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from algorithms.core.masked import masked_mean
from algorithms.core.policy_loss import aggregate, ratio_stats
from algorithms.core.registry import register_policy_loss
from xray.data.lengths import LossNorm

if TYPE_CHECKING:
    from algorithms.core.policy_loss import PolicyLoss

MAX_LOG_RATIO = 20.0
"""Clamp of the per-token log-ratio, both ways, before the exponential (veRL's)."""


@register_policy_loss("cispo")
def cispo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, loss: "PolicyLoss", weight: Optional[torch.Tensor] = None,
                      norm: Optional[LossNorm] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The CISPO loss over `[B, T-1]` inputs and its statistics (`clipfrac`, `approx_kl`, `ratio`)."""
    m = mask.to(logprobs.dtype)
    high = loss.cliprange if loss.cliprange_high is None else loss.cliprange_high
    log_ratio = torch.clamp((logprobs - old_logprobs) * m, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio).detach()
    bounded = torch.clamp(ratio, 1.0 - loss.cliprange, 1.0 + high)
    terms = -bounded * advantages * logprobs
    out = aggregate(terms if weight is None else terms * weight, m, loss.loss_agg_mode, norm)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((bounded != ratio).to(m.dtype), m), **ratio_stats(log_ratio, m)}
    return out, stats
