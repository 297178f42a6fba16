"""PPO's clipped value loss (trlX's `PPOConfig.loss`, the critic's half), as the critic's picklable
`LossFn`: the actor and the critic are separate models trained by separate engines, so the
policy loss (`algorithms.core.policy_loss`) and this one are separate too.

    value_loss = 0.5 * mean_mask( max((V - R)^2, (clip(V, V_old - cv, V_old + cv) - R)^2) )

The critic's training loss is `vf_coef * value_loss` (trlX adds that term to the policy loss of
its shared model; here it scales the critic's own gradient). Like the policy loss it averages
over the engine's whole slice of the mini-batch, given length-grouped micro-batches (`by_length`).
`ValueLoss` is a frozen dataclass so its hyper-parameters travel with it through Ray; it meets
`xray.backends.base.LossFn`, and its `reads` names the batch columns it uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from algorithms.core.masked import masked_mean
from algorithms.core.policy_loss import aggregate
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import LossNorm, loss_norm


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, cliprange_value: float,
                       norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`0.5 * mean_mask(max(unclipped, clipped squared error))` and its statistics: `clipfrac`
    (share of positions where the clipped error is the larger), `values` mean. `norm`: as in
    `aggregate` (the mean is then the slice's)."""
    m = mask.to(values.dtype)
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.max(unclipped, clipped), m, "token-mean", norm)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
                 "values": masked_mean(values, m)}
    return loss, stats


@dataclass(frozen=True)
class ValueLoss:
    """The critic's `LossFn`: reads outputs[VALUES] and batch[OLD_VALUES], batch[RETURNS],
    batch[LOSS_MASK]; returns `vf_coef * value_loss` and reports the unscaled `value_loss`."""

    reads: ClassVar[tuple[str, ...]] = (C.LOSS_MASK, C.OLD_VALUES, C.RETURNS)
    by_length: ClassVar[bool] = True
    """Engines may group and trim micro-batches by length (`xray.data.lengths`)."""
    cliprange_value: float = 0.2
    """Clip the new values to within this distance of the old values."""
    vf_coef: float = 0.1
    """Weight of the value loss (scales the critic's gradient)."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        values = outputs[C.VALUES]
        mask = batch[C.LOSS_MASK].to(values.dtype)
        loss, stats = clipped_value_loss(values, batch[C.OLD_VALUES].to(values.dtype),
                                         batch[C.RETURNS].to(values.dtype), mask, self.cliprange_value,
                                         loss_norm(batch))
        metrics = {"value_loss": float(loss.detach()), "value_clipfrac": float(stats["clipfrac"]),
                   "values": float(stats["values"])}
        return self.vf_coef * loss, metrics
