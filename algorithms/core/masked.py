"""Statistics over the response positions of a `[B, T-1]` tensor, selected by a 0/1 mask, and
advantage whitening (`algorithms/core`, the shared RL math).

Every RL quantity (rewards, advantages, losses) lives on the `LOSS_MASK` positions of the
"predict token t+1" layout (see `xray.data.columns`); these helpers are how the algorithms
average and normalise them.
"""
from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` where `mask` is 1 (over `dim`, or everything)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is 1; 0 where the mask is empty."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over the masked positions (Bessel-corrected when `unbiased`, as
    `torch.var_mean`'s default, which trlX's whitening uses)."""
    m = mask.to(x.dtype)
    count = m.sum()
    if unbiased and float(count) < 2:
        raise ValueError(f"an unbiased variance needs at least 2 masked positions, got {int(count)}; "
                         "use a larger rollout batch or unbiased=False")
    centered = (x - masked_mean(x, m)) * m
    return (centered ** 2).sum() / (count - 1 if unbiased else count).clamp(min=1.0)


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
