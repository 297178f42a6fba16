"""Several reward functions as one score, as TRL combines its `reward_funcs` with `reward_weights`,
and the per-function means a run logs.

Sits under `xray/rewards/`, used by `RewardScorer` (`loader.py`) for `reward.functions` /
`reward.weights` (`xray/config/reward.py`); one function is the case of a list of one. The rule:
a function's None (no score) is NaN; a sample's score is the sum over functions of weight x
score with the NaNs left out (TRL's `nansum`); a sample that no function scored stays NaN, for
`reward.on_nonfinite` to stop the run or drop the sample (TRL would give it 0). Each function's
mean over the samples it scored, unweighted, is the metric `reward/<name>` (`Tally`).
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Iterable, Sequence

RESERVED = ("mean", "std")
"""Metric names the run already gives `reward/`: a function with one of these names is renamed."""


def function_names(fns: Sequence[Callable]) -> list[str]:
    """Each function's metric name: its `__name__`, unless another function (or `RESERVED`) has
    it; then `<name>_<position>` (positions from 1)."""
    names = [getattr(fn, "__name__", type(fn).__name__) for fn in fns]
    return [f"{n}_{i + 1}" if names.count(n) > 1 or n in RESERVED else n for i, n in enumerate(names)]


def combine(columns: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Per sample, sum over functions of weight x score, NaN products left out; NaN where every
    product is NaN. `columns[f][i]` is function f's score (NaN for None) of sample i."""
    if len(columns) != len(weights):
        raise ValueError(f"{len(weights)} weights for {len(columns)} reward functions; give one weight per function")
    out = []
    for scores in zip(*columns):
        products = [w * s for w, s in zip(weights, scores) if not math.isnan(w * s)]
        out.append(sum(products) if products else math.nan)
    return out


class Tally:
    """Each function's sum and count of finite scores since the last `take` (thread-safe: an
    asynchronous run's makers score from several threads)."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self._sums = [0.0] * len(self.names)
        self._counts = [0] * len(self.names)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"names": self.names}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["names"])

    def add(self, columns: Sequence[Sequence[float]]) -> None:
        """Count one batch's scores, one column per function."""
        with self._lock:
            for f, scores in enumerate(columns):
                finite = [s for s in scores if math.isfinite(s)]
                self._sums[f] += math.fsum(finite)
                self._counts[f] += len(finite)

    def take_counts(self) -> dict[str, tuple[float, int]]:
        """Each function's (sum, count) since the last take, and start counting again (an
        asynchronous run's makers each send theirs: `means` joins them)."""
        with self._lock:
            out = {n: (s, c) for n, s, c in zip(self.names, self._sums, self._counts)}
            self._sums, self._counts = [0.0] * len(self.names), [0] * len(self.names)
        return out

    def take(self) -> dict[str, float]:
        """`reward/<name>`: each function's mean since the last take (`means`)."""
        return means([self.take_counts()])


def means(counts: Iterable[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """`reward/<name>`: each function's mean over several `Tally.take_counts` (left out where no
    sample was scored)."""
    total: dict[str, list] = {}
    for part in counts:
        for name, (s, c) in part.items():
            acc = total.setdefault(name, [0.0, 0])
            acc[0], acc[1] = acc[0] + s, acc[1] + c
    return {f"reward/{n}": s / c for n, (s, c) in total.items() if c}
