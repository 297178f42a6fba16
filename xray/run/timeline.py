"""A per-role timeline of one training step, as a Chrome trace (`<output-dir>/timeline.json`).

Run machinery, beside `xray.run.outputs`: the RL run loop (`xray/run/loop.py`) asks a
`StepTimeline` to `begin` just before step `trainer.timeline_step` and to `end` just after it.
`begin` drains every WholeModel's busy record (`busy_time()`, a fan-out to all its Workhorses);
`end` collects what each Workhorse was busy with during the step and writes the trace.

The trace is the Trace Event Format that Perfetto (ui.perfetto.dev) and chrome://tracing open:
one process per role (`pid`, named by a metadata event, the driver first), one thread per rank
(`tid`), and one complete event (`ph: "X"`) per busy interval, named by the Workhorse method
(`busy` where the Workhorse does not record names); `ts` and `dur` are microseconds from the
step's start, intervals clipped to the step. The driver's process holds the step's own interval.
The run report (`xray.report`) draws the same file as a Gantt chart.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

log = logging.getLogger(__name__)

TIMELINE_FILE = "timeline.json"
"""The trace's name in a run's output directory."""
DRIVER = "driver"
"""The trace's process of the run's driver (the step's wall interval)."""
ROLE_ORDER = ("actor", "critic", "reference", "teacher", "reward", "rollout")
"""Processes appear in this order (then any other role, by name)."""


def _interval(raw: Sequence) -> tuple[float, float, str]:
    """(start, end, name) of a busy interval recorded as (start, end) or (start, end, name)."""
    start, end = float(raw[0]), float(raw[1])
    return start, end, str(raw[2]) if len(raw) > 2 and raw[2] else "busy"


def _role_key(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def trace_events(shards: Iterable[dict], start: float, end: float, step: int) -> dict[str, Any]:
    """The Chrome trace of step `step` running over [start, end] (epoch seconds), from busy
    records `{"rank", "role", "intervals"}` (the answers of `busy_time()`)."""
    shards = list(shards)
    roles = sorted({s["role"] for s in shards}, key=_role_key)
    pids = {DRIVER: 0, **{role: i + 1 for i, role in enumerate(roles)}}

    def us(t: float) -> float:  # microseconds from the step's start
        return round((t - start) * 1e6, 3)

    events: list[dict] = []
    for name, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "step"}})
    events.append({"name": f"step {step}", "cat": DRIVER, "ph": "X", "pid": 0, "tid": 0, "ts": 0.0,
                   "dur": us(end), "args": {"step": step}})
    for shard in sorted(shards, key=lambda s: (_role_key(s["role"]), s["rank"])):
        pid, rank = pids[shard["role"]], int(shard["rank"])
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        for a, b, name in sorted(map(_interval, shard["intervals"])):
            a, b = max(a, start), min(b, end)
            if b > a:
                events.append({"name": name, "cat": shard["role"], "ph": "X", "pid": pid, "tid": rank,
                               "ts": us(a), "dur": round((b - a) * 1e6, 3),
                               "args": {"role": shard["role"], "rank": rank}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": step, "start_unix_s": start, "wall_s": end - start, "roles": roles}}


async def drain(models) -> list[dict]:
    """Every Workhorse's busy record since the last drain, from all the run's WholeModels at once.
    A model that fails to answer (a Workhorse just lost) is left out with a warning: the timeline
    is a diagnostic, and the run's own calls meet the loss and recover from it."""
    from xray.wholemodel.errors import WholeModelError

    found = models.all()
    answers = await asyncio.gather(*[model.busy_time() for model in found], return_exceptions=True)
    for model, answer in zip(found, answers):
        if isinstance(answer, WholeModelError):
            log.warning("the timeline leaves out %s: %s", model.role, answer)
        elif isinstance(answer, BaseException):
            raise answer
    return [shard for answer in answers if not isinstance(answer, BaseException) for shard in answer]


class StepTimeline:
    """Records the timeline of step `step` of a run (0: none) into `directory / TIMELINE_FILE`."""

    def __init__(self, step: int, directory: Path):
        self.step, self.path = step, Path(directory) / TIMELINE_FILE
        self.start: float | None = None

    async def begin(self, step: int, models) -> None:
        """Just before step `step`: if it is the recorded one, forget every busy interval so far."""
        if step == self.step and self.step > 0:
            await drain(models)
            self.start = time.time()

    async def end(self, step: int, models) -> None:
        """Just after step `step`: if it is the recorded one, collect its busy intervals and write
        the trace."""
        if step != self.step or self.start is None:
            return
        end = time.time()
        trace = trace_events(await drain(models), self.start, end, step)
        self.start = None
        try:
            self.path.write_text(json.dumps(trace))
        except OSError as exc:  # a diagnostic: the run goes on without it
            log.warning("the timeline of step %d was not written to %s (%s); free the space or set "
                        "trainer.timeline_step=0", step, self.path, exc)
            return
        log.debug("timeline of step %d: %d events in %s", step, len(trace["traceEvents"]), self.path)
