"""PPO's clipped surrogate policy loss (Schulman et al. 2017; trlX's `PPOConfig.loss`), registered
as `vanilla` (`algorithms/policy_losses`, one registered loss per file).

    ratio = exp(logprobs - old_logprobs)
    loss  = agg( max(-A * ratio, -A * clip(ratio, 1 - cliprange, 1 + cliprange_high)) )
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from algorithms.core.masked import masked_mean
from algorithms.core.policy_loss import aggregate
from algorithms.core.registry import register_policy_loss
from xray.data.lengths import LossNorm

if TYPE_CHECKING:
    from algorithms.core.policy_loss import PolicyLoss


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cliprange: float, weight: torch.Tensor | None = None,
                        cliprange_high: float | None = None,
                        agg: str = "token-mean",
                        norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss (a scalar to minimise, aggregated by `agg`) and its statistics:
    `clipfrac` (share of positions where the clipped term is the larger), `approx_kl` (k3 estimate
    of KL(old || new), `mean((ratio - 1) - log ratio)`), `ratio` mean; all over the mask. The ratio
    is clipped to `[1 - cliprange, 1 + cliprange_high]` (`cliprange_high` None: `cliprange`).
    `weight` (per token, no gradient) scales each position's term: decoupled PPO's behaviour weight.
    `norm`: the slice's denominators of a length-grouped micro-batch (`aggregate`)."""
    m = mask.to(logprobs.dtype)
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = (logprobs - old_logprobs) * m
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    terms = torch.max(unclipped, clipped)
    loss = aggregate(terms if weight is None else terms * weight, m, agg, norm)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
                 "approx_kl": masked_mean((ratio - 1.0) - log_ratio, m),
                 "ratio": masked_mean(ratio, m)}
    return loss, stats


@register_policy_loss("vanilla")
def vanilla_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, loss: "PolicyLoss", weight: Optional[torch.Tensor] = None,
                        norm: Optional[LossNorm] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`clipped_policy_loss` with `loss`'s clip ranges and aggregation."""
    return clipped_policy_loss(logprobs, old_logprobs, advantages, mask, loss.cliprange, weight,
                               loss.cliprange_high, loss.loss_agg_mode, norm)
