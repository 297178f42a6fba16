"""The actor's policy loss as a picklable `LossFn` (`algorithms/core`, the shared RL math), with
the pieces every registered policy loss shares: loss aggregation, decoupled PPO's behaviour
weight, the rollout's log-prob gap.

    policy_loss = <the registered loss `name`>(logprobs, old_logprobs, advantages, mask, ...)
                  + kl_coef * agg( KL estimate of policy || reference )      (if kl_coef > 0)

The registered losses (`algorithms.core.registry`, `algorithms/policy_losses/`): `vanilla`
(PPO's clip), `gspo` (sequence-level ratio), `cispo` (clipped, detached importance weight).

`agg` is the loss aggregation the anchors name (`AGG_MODES`): `token-mean` (every response token
of the engine's slice of the mini-batch weighs the same), `seq-mean-token-sum` (each sequence's
summed terms, averaged over sequences: Dr. GRPO), `seq-mean-token-mean` (each sequence's mean,
averaged: the GRPO paper). The loss averages over the engine's whole slice, not over one
micro-batch: engines give it length-grouped, trimmed micro-batches (`by_length`,
`xray.data.lengths`) whose meta holds the slice's denominators. `cliprange_high` above
`cliprange` is DAPO's clip-higher. A micro-batch whose approx KL to the old policy already
exceeds `max_approx_kl` contributes no gradient and reports `skipped` 1; the engines leave the
weights unchanged when every micro-batch of an update is skipped.

`PolicyLoss` is a frozen dataclass so its hyper-parameters travel with it through Ray (a lambda
would not pickle); it meets `xray.backends.base.LossFn`, and its `reads` names the batch columns
it uses, so a train step ships only those (besides the model inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from algorithms.core.kl_estimators import Estimator, kl_terms
from algorithms.core.masked import masked_mean
from algorithms.core.registry import policy_loss_fn
from xray.sync.end_to_end import GapBound, rollout_gap
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import LossNorm, loss_norm


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(terms: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm: LossNorm | None = None) -> torch.Tensor:
    """Reduce per-token `terms` `[B, T-1]` to a scalar over the masked positions, by `mode`
    (`AGG_MODES`). The sequence modes average over rows with at least one masked position. With
    `norm` (a length-grouped micro-batch) the sums divide by the slice's share instead of this
    micro-batch's own count, so that the mean over micro-batches is the slice's mean."""
    m = mask.to(terms.dtype)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")
    if mode == "token-mean":
        return masked_mean(terms, m) if norm is None else (terms * m).sum() / norm.tokens
    per_row = (terms * m).sum(1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / m.sum(1).clamp(min=1.0)
    rows = (m.sum(1) > 0).to(terms.dtype)
    count = rows.sum().clamp(min=1.0) if norm is None else norm.rows
    return (per_row * rows).sum() / count


def ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A policy loss's shared statistics of the per-token log-ratio (new - old, already masked):
    `approx_kl`, the k3 estimate of KL(old || new), `mean((ratio - 1) - log ratio)`, and the
    `ratio` mean; both over the mask, without gradient."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        return {"approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask), "ratio": masked_mean(ratio, mask)}


def behaviour_weight(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Decoupled PPO's truncated importance weight per token, `min(pi_proximal / pi_behaviour, cap)`:
    it corrects for experience sampled by older (or other) weights than the proximal policy's, the
    trainer's own log-probs before this step. 1 where the two agree; 0 off the mask."""
    m = mask.to(proximal.dtype)
    return torch.clamp(torch.exp((proximal - behaviour) * m), max=cap).detach() * m


@dataclass(frozen=True)
class PolicyLoss:
    """The actor's `LossFn`: reads outputs[LOGPROBS] (and ENTROPY if the engine returns it) and
    batch[OLD_LOGPROBS], batch[ADVANTAGES], batch[LOSS_MASK] (and batch[REF_LOGPROBS] with a KL
    loss term)."""

    cliprange: float = 0.2
    """Clip the probability ratio to [1 - cliprange, 1 + cliprange_high]."""
    behaviour_weight_cap: Optional[float] = None
    """Set (asynchronous training, or a quantized rollout): OLD_LOGPROBS are the proximal policy's
    (the actor's own) and each token's term is weighted by `behaviour_weight` against
    batch[BEHAVIOUR_LOGPROBS] (the rollout engine's, which sampled), truncated at this cap."""
    cliprange_high: Optional[float] = None
    """Upper clip of the ratio (DAPO's clip-higher); None: `cliprange`."""
    loss_agg_mode: str = "token-mean"
    """How per-token terms become the loss: one of `AGG_MODES`."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (GRPO's beta); 0: no term, REF_LOGPROBS not read."""
    kl_estimator: Estimator = "k3"
    """Per-token estimate of the KL loss term (`algorithms.core.kl_estimators`)."""
    max_approx_kl: Optional[float] = None
    """Skip (no gradient, `skipped` 1) a micro-batch whose approx KL to the old policy exceeds this."""
    by_length: ClassVar[bool] = True
    """Engines may group and trim micro-batches by length (`xray.data.lengths`)."""
    on_policy: bool = False
    """The batch was sampled with the weights being trained and this is their only update (one
    epoch, one mini-batch): the old log-probs are this forward's own, detached (ratio 1, the
    gradient of `A log p`), so OLD_LOGPROBS is not read and no separate forward makes it."""
    end_to_end_bound: Optional[GapBound] = None
    """Where no separate forward recomputes the actor's log-probs (`on_policy`), the end-to-end
    check of the last weight sync rides on this forward, before the update: |log-prob - the
    rollout's (BEHAVIOUR_LOGPROBS)| over the response tokens must stay within it (the largest in
    fp32, the mean in bf16: `xray.sync.end_to_end.GapBound`),
    else the micro-batch asks the engine to leave the whole update out (`abort_update` 1, every
    replica agreeing) and the trainer fails the run. Reports `rollout_gap_mean` and
    `rollout_gap_max` (their means over micro-batches). None: no check."""

    routing: bool = False
    """The engine's forward replays the rollout's expert routing (ROUTED_EXPERTS, a mixture of
    experts' `moe.routing_replay`): the column ships with the batch."""
    name: str = "vanilla"
    """The registered policy loss this computes (`algorithms.core.registry`; `ppo.policy_loss`)."""

    def __post_init__(self) -> None:
        policy_loss_fn(self.name)  # an unknown name fails where the loss is made, not on the engines

    @property
    def reads(self) -> tuple[str, ...]:
        base = (C.LOSS_MASK, C.ADVANTAGES) if self.on_policy else (C.LOSS_MASK, C.OLD_LOGPROBS, C.ADVANTAGES)
        if self.routing:
            base = (*base, C.ROUTED_EXPERTS)
        if self.kl_coef:
            base = (*base, C.REF_LOGPROBS)
        weighs = self.behaviour_weight_cap is not None or self.end_to_end_bound is not None
        return (*base, C.BEHAVIOUR_LOGPROBS) if weighs else base

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = outputs[C.LOGPROBS]
        mask = batch[C.LOSS_MASK].to(logprobs.dtype)
        old = logprobs.detach() if self.on_policy else batch[C.OLD_LOGPROBS].to(logprobs.dtype)
        weight = None
        if self.behaviour_weight_cap is not None:
            weight = behaviour_weight(old, batch[C.BEHAVIOUR_LOGPROBS].to(logprobs.dtype), mask,
                                      self.behaviour_weight_cap)
        loss, stats = policy_loss_fn(self.name)(logprobs, old, batch[C.ADVANTAGES].to(logprobs.dtype), mask,
                                                self, weight, loss_norm(batch))
        metrics = {"policy_loss": float(loss.detach()), "policy_clipfrac": float(stats["clipfrac"]),
                   "approx_kl": float(stats["approx_kl"]), "ratio": float(stats["ratio"])}
        if self.kl_coef:
            kl = aggregate(kl_terms(logprobs, batch[C.REF_LOGPROBS].to(logprobs.dtype), self.kl_estimator) * mask,
                           mask, self.loss_agg_mode, loss_norm(batch))
            loss = loss + self.kl_coef * kl
            metrics["kl_loss"] = float(kl.detach())
        if self.max_approx_kl is not None:
            skipped = float(stats["approx_kl"]) > self.max_approx_kl
            loss = loss * 0.0 if skipped else loss
            metrics["skipped"] = float(skipped)
        if weight is not None:
            metrics["behaviour_weight"] = float(masked_mean(weight, mask))
        if C.ENTROPY in outputs:
            metrics["entropy"] = float(masked_mean(outputs[C.ENTROPY].detach(), mask))
        if self.end_to_end_bound is not None:
            gap = rollout_gap(logprobs.detach(), batch[C.BEHAVIOUR_LOGPROBS], mask)
            failed = not self.end_to_end_bound.holds(gap)  # also NaN
            metrics.update(rollout_gap_mean=gap["rollout_logprob_gap_mean"],
                           rollout_gap_max=gap["rollout_logprob_gap_max"], abort_update=float(failed))
            loss = loss * 0.0 if failed else loss
        return loss, metrics
