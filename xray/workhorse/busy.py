"""Busy time of a Workhorse: the wall-clock intervals it spends inside its methods.

Every Workhorse keeps them (`BusyRecorder`, a base of `xray.workhorse.base.Workhorse`): the call
entry times each served method whole, and methods that also wait on other Workhorses or move data
(`SELF_TIMED`) mark their own busy parts with `busy()` / `timed()`. `busy_time()` drains them as
(start, end, method) epoch-second triples. Readers: a run's per-role timeline of one step
(`timeline.json`, drawn by `python -m xray.report`) and the benchmarks that tell model compute from
the runtime's own overhead (`benchmarks/ppo_step.py`, `benchmarks/weight_sync.py`).
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence

from xray.protocol import fanout

_END = object()


def covered_seconds(intervals: Iterable[Sequence], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Seconds of [lo, hi] inside at least one of `intervals` ((start, end, ...) of several
    Workhorses: calls that overlap count once, calls one after another add up)."""
    clipped = sorted((max(i[0], lo), min(i[1], hi)) for i in intervals if i[1] > lo and i[0] < hi)
    total, reached = 0.0, lo
    for a, b in clipped:
        if b > reached:
            total += b - max(a, reached)
            reached = b
    return total


class BusyRecorder:
    """Busy intervals of one Workhorse; its subclasses' `call` entry times each method."""

    SELF_TIMED: frozenset[str] = frozenset({"busy_time"})
    """Methods that count their own busy time (with `busy()`) instead of `call` timing them whole:
    those that also wait on other Workhorses or move data."""
    MAX_INTERVALS = 10_000
    """Busy intervals kept until `busy_time()` drains them (the oldest go first)."""

    role: str
    rank: int

    def _init_busy(self) -> None:
        self._busy: deque[tuple[float, float, str]] = deque(maxlen=self.MAX_INTERVALS)
        self._serving = "busy"

    @contextmanager
    def serving(self, method: str) -> Iterator[None]:
        """Serve `method`: timed whole unless it is self-timed; its own `busy()` blocks carry its name."""
        self._serving = method
        if method in self.SELF_TIMED:
            yield
            return
        with self.busy():
            yield

    @contextmanager
    def busy(self, name: Optional[str] = None) -> Iterator[None]:
        """Count the time inside this block as busy (wall-clock epoch seconds)."""
        start = time.time()
        try:
            yield
        finally:
            self._busy.append((start, time.time(), name or self._serving))

    def timed(self, items: Iterable) -> Iterator:
        """Yield from `items`, counting only the time spent producing each item as busy."""
        it = iter(items)
        while True:
            with self.busy():
                item = next(it, _END)
            if item is _END:
                return
            yield item

    @fanout(dispatch="all", collect=lambda layout, results: results, deadline_s=30.0)
    def busy_time(self) -> dict:
        """This shard's busy intervals since the last call, then cleared (this call not counted)."""
        intervals = list(self._busy)
        self._busy.clear()
        return {"rank": self.rank, "role": self.role, "intervals": intervals,
                "busy_s": sum(end - start for start, end, _ in intervals)}
