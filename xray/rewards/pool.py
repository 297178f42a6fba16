"""Worker processes for reward functions: a process pool started on first use and reused.

Sits under `xray/rewards/`: `RewardScorer` (`loader.py`) calls synchronous reward functions in one
with `reward.workers` (`call_chunks`: one contiguous chunk of the batch per worker), and the
`math_verify` reward (`math_answer.py`, `symbolic.py`) checks each sample in one with a deadline
kept by the parent (`map_timed`): a sample past it comes back as `TIMED_OUT` and the pool's
workers are killed and replaced (a process pool cannot lose one worker and go on). No signal and
no thread is asked to stop anything: a worker runs each task in its own main thread.

Workers start with `forkserver` where the platform has it, else `spawn`: never `fork`, which would
copy the caller's threads and locks (Ray, torch) into the child. A pool is started lazily, waits
until every worker has run its initializer (so that starting never eats a sample's deadline), and
is left out when its owner is pickled (a Ray actor gets its own on first use).
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger(__name__)

START_S = 300.0
"""How long a new pool's workers may take to start and run their initializer."""


class _TimedOut:
    def __repr__(self) -> str:
        return "TIMED_OUT"


TIMED_OUT = _TimedOut()
"""`map_timed`'s answer for an item that ran past its deadline (or broke its worker twice)."""


class PoolStartError(RuntimeError):
    """The workers of a reward pool did not start; carries the reason."""


def _start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _initialize(barrier, initializer: Optional[Callable[[], None]]) -> None:
    """Run in each new worker: the owner's initializer, then wait for the pool's other workers."""
    if initializer is not None:
        initializer()
    barrier.wait(START_S)


def _ready() -> bool:
    return True


class ProcessPool:
    """`workers` processes, started on first use, replaced when one hangs or dies."""

    def __init__(self, workers: int, initializer: Optional[Callable[[], None]] = None):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least 1 worker, got {workers}")
        self.workers, self.initializer = workers, initializer
        self.replaced = 0
        """How many times the workers were killed and replaced (a hung or dead worker)."""
        self._executor: Optional[ProcessPoolExecutor] = None
        self._lock = threading.Lock()
        self._running = threading.Lock()

    def __getstate__(self) -> dict:
        return {"workers": self.workers, "initializer": self.initializer}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["workers"], state["initializer"])

    def executor(self) -> ProcessPoolExecutor:
        """The live pool, started (and waited for) when there is none."""
        with self._lock:
            if self._executor is None:
                self._executor = self._start()
            return self._executor

    def _start(self) -> ProcessPoolExecutor:
        ctx = multiprocessing.get_context(_start_method())
        barrier = ctx.Barrier(self.workers)
        ex = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_initialize,
                                 initargs=(barrier, self.initializer))
        ready = [ex.submit(_ready) for _ in range(self.workers)]  # one submit spawns one worker
        done, _ = wait(ready, timeout=START_S)
        failed = [f for f in ready if f not in done or f.exception() is not None]
        if failed:
            _kill(ex)
            reason = "timed out" if failed[0] not in done else repr(failed[0].exception())
            raise PoolStartError(f"the {self.workers} reward worker processes did not start ({reason}); check that "
                                 "the reward's module imports in a fresh Python process, or set reward.workers=0")
        return ex

    def replace(self) -> None:
        """Kill the workers (a hung or dead one among them); the next use starts new ones."""
        with self._lock:
            if self._executor is not None:
                _kill(self._executor)
                self._executor = None
                self.replaced += 1

    def close(self) -> None:
        """Stop the workers now (they are idle between calls)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

    def call_chunks(self, fn: Callable, chunks: Sequence[tuple]) -> list:
        """`[fn(*args) for args in chunks]`, the chunks at once in the workers; an exception in
        `fn` is raised here as it was raised there. A worker that dies (a crash, out of memory)
        raises `BrokenProcessPool` after the pool is replaced."""
        ex = self.executor()
        futures = [ex.submit(fn, *args) for args in chunks]
        try:
            return [f.result() for f in futures]
        except BrokenProcessPool:
            self.replace()
            raise

    def map_timed(self, fn: Callable[[Any], Any], items: Sequence[Any], timeout_s: float) -> list:
        """`[fn(item) for item in items]` in the workers, each item given `timeout_s` seconds from
        when a free worker takes it: at most `workers` items are out at a time, so an item's clock
        starts with its run, not in a queue. An item past its deadline is `TIMED_OUT` and the
        workers are replaced, the items that were running beside it going again on the new ones;
        an item running when a worker died goes again once, then is `TIMED_OUT` too. Calls from
        several threads take turns (a replacement must not break another call's items)."""
        with self._running:
            return self._map_timed(fn, items, timeout_s)

    def _map_timed(self, fn: Callable[[Any], Any], items: Sequence[Any], timeout_s: float) -> list:
        results: list = [None] * len(items)
        queue, broken = deque(range(len(items))), [0] * len(items)
        running: dict[Future, tuple[int, float]] = {}
        while queue or running:
            ex = self.executor()
            while queue and len(running) < self.workers:
                i = queue.popleft()
                running[ex.submit(fn, items[i])] = (i, time.monotonic())
            first_deadline = min(start for _, start in running.values()) + timeout_s
            done, _ = wait(list(running), timeout=max(0.0, first_deadline - time.monotonic()),
                           return_when=FIRST_COMPLETED)
            lost = False
            for f in done:
                i, _ = running.pop(f)
                if isinstance(f.exception(), BrokenProcessPool):
                    lost, broken[i] = True, broken[i] + 1
                    if broken[i] < 2:
                        queue.appendleft(i)
                    else:
                        results[i] = TIMED_OUT
                else:
                    results[i] = f.result()  # fn's own exception is raised here
            now = time.monotonic()
            late = [f for f, (_, start) in running.items() if now - start >= timeout_s]
            for f in late:
                i, start = running.pop(f)
                results[i] = TIMED_OUT
                log.warning("a reward worker ran past its %.1f s deadline on item %d: scored as timed out, "
                            "workers replaced", timeout_s, i)
            if late or lost:
                queue.extendleft(reversed([i for i, _ in running.values()]))  # they go again, in order
                running.clear()
                self.replace()
        return results


def _kill(ex: ProcessPoolExecutor) -> None:
    """Kill the pool's worker processes at once (Python 3.14 has `kill_workers`; before it, the
    pool's own table of processes is the only handle on them), then let the pool go."""
    kill = getattr(ex, "kill_workers", None)
    processes = list((getattr(ex, "_processes", None) or {}).values())
    if kill is not None:
        kill()
    else:
        for p in processes:
            if p.is_alive():
                p.kill()
    for p in processes:
        p.join(5.0)
    ex.shutdown(wait=False, cancel_futures=True)
