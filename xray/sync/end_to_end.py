"""The end-to-end part of the verified sync: how far the rollout engine's log-probs of its own
samples are from the actor's recomputation of the same tokens. The run's step checks it before a
batch is trained on (`xray/run/verify.py`), and an on-policy policy loss inside its training
forward (`algorithms/core/policy_loss.py`).
"""
from __future__ import annotations

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
