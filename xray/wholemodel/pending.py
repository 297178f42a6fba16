"""`Pending`: the answer of one WholeModel call, held as object references until someone needs it.

A call's shard tasks are submitted by the caller straight to the Workhorses, so the caller owns
their results: the bytes go from each Workhorse to whoever reads them, never through the
WholeModel Ray actor. A `Pending` can be
- awaited (`await p`) or waited on (`p.get()`): the shard results are fetched, failures become one
  `WholeModelError` (or `WorkhorseDied`) naming the ranks, and the collect rule of the method
  (`xray.protocol.collect`) builds the answer on the caller's side;
- passed as an argument of another WholeModel call (by reference): the receiving Workhorses fetch
  the parts they need themselves, and the caller never holds the data (`parts`).
A call that passes its deadline cancels its unfinished shard tasks (`ray.cancel`): a task still
queued never runs, and a running one that polls `Workhorse.cancelled()` stops, so later calls do
not queue behind it.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from xray import protocol
from xray.backends.base import ShardInfo
from xray.wholemodel.errors import CallDeadlineExceeded, ShardFailure, WholeModelError, WorkhorseDied


def shard_failure(role: str, rank: int, exc: BaseException) -> tuple[ShardFailure, bool]:
    """The ShardFailure of one rank's exception, and whether its Workhorse died."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return ShardFailure(rank, f"Workhorse {role} rank {rank} died ({type(exc).__name__}: its process is "
                                  "gone); shut this WholeModel down and build it again", str(exc)), True
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RayActorError):  # an input passed by reference whose producer died
            return ShardFailure(rank, f"an input passed by reference was lost: the Workhorse that produced it "
                                      f"died ({type(cause).__name__}); call the producing model again",
                                str(exc)), False
        return ShardFailure(rank, f"{type(cause).__name__}: {cause}",
                            getattr(exc, "traceback_str", None) or str(exc)), False
    return ShardFailure(rank, f"{type(exc).__name__}: {exc}", repr(exc)), False


class Pending:
    """The answer of a WholeModel call: `await` it, `.get()` it, or pass it to another call."""

    def __init__(self, role: str, method: str, meta: protocol.FanOut, layout: Sequence[ShardInfo],
                 refs: list, ranks: list[int], deadline_s: float):
        self.role, self.method, self.meta, self.layout = role, method, meta, list(layout)
        self.refs, self.ranks = refs, ranks
        """One object ref per shard task, and the rank each ran on."""
        self.deadline_s = deadline_s
        self._started = time.monotonic()
        self._answer: Any = _UNSET

    def __repr__(self) -> str:
        state = "done" if self._answer is not _UNSET else "pending"
        return f"<Pending {self.role}.{self.method} on {len(self.refs)} shards, {state}>"

    # -- by reference ------------------------------------------------------------------------
    @property
    def parts(self) -> list:
        """Refs of the answer's parts in data-parallel order (a `flatten` method's collectors)."""
        if self.meta.collect != "flatten":
            raise TypeError(f"{self.role}.{self.method} collects with {self.meta.collect!r}; only the answer "
                            "of a collect='flatten' method can be passed by reference: await it first")
        if self.meta.execute == "first":
            return list(self.refs)
        by_rank = dict(zip(self.ranks, self.refs))
        return [by_rank[r] for r in protocol.collectors(self.layout)]

    # -- waiting -----------------------------------------------------------------------------
    def _remaining(self, timeout: float | None) -> float:
        left = self.deadline_s - (time.monotonic() - self._started)
        return max(0.0, left if timeout is None else min(left, timeout))

    def _deadline_passed(self, unfinished: list) -> CallDeadlineExceeded:
        import ray

        for ref in unfinished:
            ray.cancel(ref)
        ranks = [rank for rank, ref in zip(self.ranks, self.refs) if ref in unfinished]
        return CallDeadlineExceeded(self.role, self.method, self.deadline_s, ranks)

    def _answer_of(self, outcomes: list[tuple[bool, Any]]) -> Any:
        failures, died = [], False
        for rank, (ok, value) in zip(self.ranks, outcomes):
            if not ok:
                failure, dead = shard_failure(self.role, rank, value)
                failures.append(failure)
                died |= dead
        if failures:
            raise (WorkhorseDied if died else WholeModelError)(self.role, self.method, failures, len(self.layout))
        results = [value for _, value in outcomes]
        if self.meta.execute == "first":
            answer = results[0]
        else:
            answer = protocol.collect(self.layout, self.meta.collect, results)
        self._answer = answer
        return answer

    def get(self, timeout: float | None = None) -> Any:
        """Block until every shard answered (or the deadline passed); the collected answer."""
        import ray

        if self._answer is not _UNSET:
            return self._answer
        _, unfinished = ray.wait(self.refs, num_returns=len(self.refs), timeout=self._remaining(timeout),
                                 fetch_local=False)
        if unfinished:
            raise self._deadline_passed(unfinished)
        try:
            outcomes = [(True, value) for value in ray.get(self.refs)]
        except Exception:  # noqa: BLE001 - then find every failing rank
            outcomes = []
            for ref in self.refs:
                try:
                    outcomes.append((True, ray.get(ref)))
                except Exception as exc:  # noqa: BLE001 - each rank's failure is reported
                    outcomes.append((False, exc))
        return self._answer_of(outcomes)

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        if self._answer is not _UNSET:
            return self._answer
        futures = [asyncio.ensure_future(_awaited(ref)) for ref in self.refs]
        unfinished = set(futures)
        while unfinished:
            done, unfinished = await asyncio.wait(unfinished, timeout=self._remaining(None),
                                                  return_when=asyncio.FIRST_EXCEPTION)
            if not done:
                for f in unfinished:
                    f.cancel()
                raise self._deadline_passed([r for r, f in zip(self.refs, futures) if f in unfinished])
            dead = [(rank, f.exception()) for rank, f in zip(self.ranks, futures) if f in done
                    and f.exception() is not None and shard_failure(self.role, rank, f.exception())[1]]
            if dead and unfinished:  # the others may wait on the dead one in a collective: do not wait
                for f in unfinished:
                    f.cancel()
                raise WorkhorseDied(self.role, self.method, [shard_failure(self.role, r, e)[0] for r, e in dead],
                                    len(self.layout))
        outcomes = [(True, f.result()) if f.exception() is None else (False, f.exception()) for f in futures]
        return self._answer_of(outcomes)


async def _awaited(ref) -> Any:
    return await ref


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> str:
        return "_UNSET"  # one sentinel in every process: a Pending passed to another actor stays pending


_UNSET = _Unset()
