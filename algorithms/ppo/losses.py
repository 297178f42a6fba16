"""PPO's clipped policy and value losses (trlX's `PPOConfig.loss`), split in two because the actor
and the critic are separate models trained by separate engines.

    ratio       = exp(logprobs - old_logprobs)
    policy_loss = mean_mask( max(-A * ratio, -A * clip(ratio, 1 - cliprange, 1 + cliprange)) )
    value_loss  = 0.5 * mean_mask( max((V - R)^2, (clip(V, V_old - cv, V_old + cv) - R)^2) )

The critic's training loss is `vf_coef * value_loss` (trlX adds that term to the policy loss of
its shared model; here it scales the critic's own gradient). `PolicyLoss` and `ValueLoss` are
frozen dataclasses so their hyper-parameters travel with them through Ray (a lambda would not
pickle); each meets `xray.backends.base.LossFn`, and its `reads` names the batch columns it uses,
so a train step ships only those (besides the model inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from algorithms.ppo.masked import masked_mean
from xray.data import columns as C
from xray.data.batch import Batch


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cliprange: float,
                        weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss (a scalar to minimise) and its statistics: `clipfrac` (share of
    positions where the clipped term is the larger), `approx_kl` (k3 estimate of
    KL(old || new), `mean((ratio - 1) - log ratio)`), `ratio` mean; all over the mask. `weight`
    (per token, no gradient) scales each position's term: decoupled PPO's behaviour weight."""
    m = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * m
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    terms = torch.max(unclipped, clipped)
    loss = masked_mean(terms if weight is None else terms * weight, m)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
                 "approx_kl": masked_mean((ratio - 1.0) - log_ratio, m),
                 "ratio": masked_mean(ratio, m)}
    return loss, stats


def behaviour_weight(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Decoupled PPO's truncated importance weight per token, `min(pi_proximal / pi_behaviour, cap)`:
    it corrects for experience sampled by older (or other) weights than the proximal policy's, the
    trainer's own log-probs before this step. 1 where the two agree; 0 off the mask."""
    m = mask.to(proximal.dtype)
    return torch.clamp(torch.exp((proximal - behaviour) * m), max=cap).detach() * m


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`0.5 * mean_mask(max(unclipped, clipped squared error))` and its statistics: `clipfrac`
    (share of positions where the clipped error is the larger), `values` mean."""
    m = mask.to(values.dtype)
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), m)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(m.dtype), m),
                 "values": masked_mean(values, m)}
    return loss, stats


@dataclass(frozen=True)
class PolicyLoss:
    """The actor's `LossFn`: reads outputs[LOGPROBS] (and ENTROPY if the engine returns it) and
    batch[OLD_LOGPROBS], batch[ADVANTAGES], batch[LOSS_MASK]."""

    cliprange: float = 0.2
    """Clip the probability ratio to [1 - cliprange, 1 + cliprange]."""
    behaviour_weight_cap: float | None = None
    """Set (asynchronous training): OLD_LOGPROBS are the proximal policy's and each token's term is
    weighted by `behaviour_weight` against batch[BEHAVIOUR_LOGPROBS], truncated at this cap."""

    @property
    def reads(self) -> tuple[str, ...]:
        base = (C.LOSS_MASK, C.OLD_LOGPROBS, C.ADVANTAGES)
        return base if self.behaviour_weight_cap is None else (*base, C.BEHAVIOUR_LOGPROBS)

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = outputs[C.LOGPROBS]
        mask = batch[C.LOSS_MASK].to(logprobs.dtype)
        old = batch[C.OLD_LOGPROBS].to(logprobs.dtype)
        weight = None
        if self.behaviour_weight_cap is not None:
            weight = behaviour_weight(old, batch[C.BEHAVIOUR_LOGPROBS].to(logprobs.dtype), mask,
                                      self.behaviour_weight_cap)
        loss, stats = clipped_policy_loss(logprobs, old, batch[C.ADVANTAGES].to(logprobs.dtype), mask,
                                          self.cliprange, weight)
        metrics = {"policy_loss": float(loss.detach()), "policy_clipfrac": float(stats["clipfrac"]),
                   "approx_kl": float(stats["approx_kl"]), "ratio": float(stats["ratio"])}
        if weight is not None:
            metrics["behaviour_weight"] = float(masked_mean(weight, mask))
        if C.ENTROPY in outputs:
            metrics["entropy"] = float(masked_mean(outputs[C.ENTROPY].detach(), mask))
        return loss, metrics


@dataclass(frozen=True)
class ValueLoss:
    """The critic's `LossFn`: reads outputs[VALUES] and batch[OLD_VALUES], batch[RETURNS],
    batch[LOSS_MASK]; returns `vf_coef * value_loss` and reports the unscaled `value_loss`."""

    reads: ClassVar[tuple[str, ...]] = (C.LOSS_MASK, C.OLD_VALUES, C.RETURNS)
    cliprange_value: float = 0.2
    """Clip the new values to within this distance of the old values."""
    vf_coef: float = 0.1
    """Weight of the value loss (scales the critic's gradient)."""

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        values = outputs[C.VALUES]
        mask = batch[C.LOSS_MASK].to(values.dtype)
        loss, stats = clipped_value_loss(values, batch[C.OLD_VALUES].to(values.dtype),
                                         batch[C.RETURNS].to(values.dtype), mask, self.cliprange_value)
        metrics = {"value_loss": float(loss.detach()), "value_clipfrac": float(stats["clipfrac"]),
                   "values": float(stats["values"])}
        return self.vf_coef * loss, metrics
