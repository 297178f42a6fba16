"""Per-token estimates of KL(policy || reference) from the log-probs of sampled tokens (Schulman,
"Approximating KL divergence", 2020), as veRL and OpenRLHF name them (`algorithms/core`, the
shared RL math). With `d = ref - logp`:

    k1 = -d                  unbiased, can be negative on a single token
    k2 = d^2 / 2             biased, low variance
    k3 = exp(d) - d - 1      unbiased, never negative ("low_var_kl")

trlX's `exp(logp - ref) - 1 - (logp - ref)` uses the opposite sign of `d`: it is not an unbiased
estimate of this KL and grows without bound as the policy leaves the reference (a nearly
deterministic policy reported thousands). Metrics use the means per token over the mask.
"""
from __future__ import annotations

from typing import Literal

import torch

from algorithms.core.masked import masked_mean

Estimator = Literal["k1", "k2", "k3"]
ESTIMATORS = ("k1", "k2", "k3")


def kl_terms(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Estimator = "k1") -> torch.Tensor:
    """The per-token estimate, same shape as the inputs (differentiable in `logprobs`)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
             estimator: Estimator = "k1") -> float:
    """Mean of the per-token estimate over the masked positions."""
    return float(masked_mean(kl_terms(logprobs.float(), ref_logprobs.float(), estimator), mask))


def kl_metrics(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """A step's KL figures: `kl` the mean per-token k1, `kl_k3` the mean per-token k3, and
    `kl_sequence` the k1 summed over each response, averaged over the rows (what an adaptive KL
    controller's target is measured in)."""
    m = mask.to(torch.float32)
    k1 = kl_terms(logprobs.float(), ref_logprobs.float(), "k1") * m
    return {"kl": float(masked_mean(k1, m)), "kl_k3": token_kl(logprobs, ref_logprobs, m, "k3"),
            "kl_sequence": float(k1.sum(1).mean())}
