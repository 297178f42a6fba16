"""GSPO's policy loss (Zheng et al. 2025, arXiv 2507.18071, its GSPO-token form), registered as
`gspo` (`algorithms/policy_losses`, one registered loss per file): the importance ratio is the
sequence's, the geometric mean of its tokens' ratios, so every token of a response is clipped
(or not) together.

    s_i    = exp( mean over response i's tokens of (logprobs - old_logprobs) )
    s_i,t  = sg(s_i) * pi(y_i,t) / sg(pi(y_i,t))         (value s_i; gradient of log pi(y_i,t))
    loss   = agg( max(-A * s_i,t, -A * clip(s_i,t, 1 - cliprange, 1 + cliprange_high)) )

The log of `s_i,t` is clamped at 10 before the exponential, as veRL's `compute_policy_loss_gspo`
(`verl/trainer/ppo/core_algos.py`), whose value and gradient this matches. veRL always
aggregates GSPO by `seq-mean-token-mean`; here `ppo.loss_agg_mode` decides (set it to
`seq-mean-token-mean` for the paper's and veRL's loss). The paper's clip ranges are tiny (3e-4 and
4e-4): a sequence ratio moves far less than a token's. `approx_kl` and `ratio` are the token-level
statistics every policy loss reports (`ratio_stats`), so `ppo.max_approx_kl` means the same.
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

MAX_LOG_RATIO = 10.0
"""Clamp of the combined log-ratio before the exponential (veRL's, for numerical safety)."""


@register_policy_loss("gspo")
def gspo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, loss: "PolicyLoss", weight: Optional[torch.Tensor] = None,
                     norm: Optional[LossNorm] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GSPO-token loss over `[B, T-1]` inputs and its statistics (`clipfrac`: the share of
    response tokens whose clipped term is the larger; `approx_kl`, `ratio`: `ratio_stats`)."""
    m = mask.to(logprobs.dtype)
    high = loss.cliprange if loss.cliprange_high is None else loss.cliprange_high
    log_ratio = (logprobs - old_logprobs) * m
    seq_log_ratio = log_ratio.sum(1) / m.sum(1).clamp(min=1.0)
    combined = (logprobs - logprobs.detach()) + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(combined.clamp(max=MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - loss.cliprange, 1.0 + high)
    terms = torch.max(unclipped, clipped)
    out = aggregate(terms if weight is None else terms * weight, m, loss.loss_agg_mode, norm)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m), **ratio_stats(log_ratio, m)}
    return out, stats
