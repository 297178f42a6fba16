"""The end-to-end part of the verified sync: how far the rollout engine's log-probs of its own
samples are from the actor's recomputation of the same tokens, and the bound that judges it. The
run's step checks it before a batch is trained on (`xray/run/verify.py`), an on-policy policy loss
inside its training forward (`algorithms/core/policy_loss.py`), and a sync's probe on a few
sequences (`xray/sync/weights.py`).

Which statistic is bounded depends on the dtypes. In fp32 both sides compute the same numbers up to
rounding (2e-5 on the real model), so the largest gap of any token is bounded, tightly
(`sync.tolerance`). In bf16 each implementation rounds its own way, and the per-token gap is noise
with a long tail: on SmolLM2-135M-Instruct (Megatron bf16 against vLLM bf16, 256 samples of 24
tokens, three batches) the mean gap was 0.046-0.048 while the largest reached 0.45-0.76 (a real
run's 0.874 had failed the former per-token bound of 0.5); so the mean is bounded there
(`sync.bf16_mean_tolerance`) and the largest is a metric only. A wrong weight, a wrong name mapping
or a model serving other weights moves the mean on every token, not one token's tail. What no
log-prob statistic can see in bf16 is a rollout one optimizer step behind (lr 1e-5): the actor's
own two bf16 versions differ by as much as the two implementations (rms 0.066 per token; a rollout
a step behind has mean 0.047 against 0.046-0.047 current, and its log-probs regress on the update
by 0.45-0.49 against 0.47-0.55 synced: `benchmarks/bf16_end_to_end.py`), so the exact part of the
sync carries that proof (`xray/sync/weights.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


def rollout_gap(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of its own samples (`behaviour`) are from the actor's
    (`old`), per response token: `rollout_logprob_gap_mean` and `_max` of |old - behaviour| over
    the mask (0 without masked tokens). bf16 or a quantized rollout makes it large by design."""
    m = mask.to(torch.float32) > 0
    gap = (old.to(torch.float32) - behaviour.to(torch.float32)).abs()[m]
    if not gap.numel():
        return {"rollout_logprob_gap_mean": 0.0, "rollout_logprob_gap_max": 0.0}
    return {"rollout_logprob_gap_mean": float(gap.mean()), "rollout_logprob_gap_max": float(gap.max())}


@dataclass(frozen=True)
class GapBound:
    """The end-to-end check's bound: on the largest per-token gap ("max", fp32 on both sides) or on
    the mean gap over the response tokens ("mean", bf16 or a quantized rollout)."""

    statistic: Literal["max", "mean"]
    value: float

    def holds(self, gap: dict[str, float]) -> bool:
        """Whether a `rollout_gap` answer is within the bound (NaN is not)."""
        return bool(gap[f"rollout_logprob_gap_{self.statistic}"] <= self.value)

    def __str__(self) -> str:
        return f"{self.statistic} gap per token <= {self.value:g}"
