"""The numbers of an evaluation (pure: no models, no files): mean@k, the unbiased pass@k and their
per-source breakdown, from each held-out prompt's k scored responses. `xray/run/evaluate.py`
samples and scores the responses and calls `eval_metrics`; the run logs what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Sequence

UNKNOWN_SOURCE = "unknown"
"""The source of a prompt whose row has no value in `eval.source_field`."""


@dataclass(frozen=True)
class PromptResult:
    """One held-out prompt's responses as scored."""

    rewards: tuple[float | None, ...]
    """One reward per response; None where the reward dropped it (a non-finite score, `reward.on_nonfinite: skip`)."""
    source: str | None = None
    """Its `eval.source_field` value (None: the data has no such column)."""

    def correct(self, threshold: float) -> int:
        """How many responses reached `threshold` (a dropped one never does)."""
        return sum(r is not None and r >= threshold for r in self.rewards)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et al., 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summary(results: Sequence[PromptResult], pass_k: Sequence[int], threshold: float) -> dict[str, float]:
    """`mean_reward` (mean@k: the mean over every kept response of every prompt) and `pass@k` for
    each k (the mean over the prompts of `pass_at_k`), keys without a prefix."""
    kept = [r for result in results for r in result.rewards if r is not None]
    out = {"mean_reward": sum(kept) / len(kept) if kept else 0.0}
    for k in pass_k:
        estimates = [pass_at_k(len(p.rewards), p.correct(threshold), k) for p in results if len(p.rewards) >= k]
        out[f"pass@{k}"] = sum(estimates) / len(estimates) if estimates else 0.0
    return out


def eval_metrics(results: Sequence[PromptResult], pass_k: Sequence[int], threshold: float) -> dict[str, float]:
    """The metrics an evaluation logs: `eval` (the headline, the mean reward as ever), `eval/mean_reward`
    and `eval/pass@k` over all prompts, and `eval/<source>/...` per source when the prompts carry one."""
    whole = summary(results, pass_k, threshold)
    out = {"eval": whole["mean_reward"], **{f"eval/{k}": v for k, v in whole.items()}}
    if any(r.source is not None for r in results):
        sources = sorted({_source(r) for r in results})
        for source in sources:
            part = summary([r for r in results if _source(r) == source], pass_k, threshold)
            out.update({f"eval/{source}/{k}": v for k, v in part.items()})
    return out


def _source(result: PromptResult) -> str:
    return UNKNOWN_SOURCE if result.source is None else result.source
