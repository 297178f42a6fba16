"""Drain notices read while a synchronous step runs: wait for the step, or abort it.

A Workhorse told to drain (SIGTERM, `xray/workhorse/drain.py`) serves on for `trainer.drain_grace_s`
seconds. A synchronous run (`xray.run.loop.sync_steps`) runs each step through `StepDrains.run`,
which reads the run's drain inbox five times a second while the step is under way. When a notice comes
and the step, by the longest of the last steps, will end well inside the grace (its expected rest
at most half the grace), the step finishes and the model is replaced at its boundary from its
snapshot (`replace_drained`): nothing runs again. When it would not (steps of minutes, a grace of
seconds), the step is aborted at once (`StepAborted`), the drained models replaced and every
trained model, the trainer's state and the prompt sampler restored from the last step's snapshot
in memory (`replace_drained(..., aborted=True)`): only the aborted step runs again, and no
restart is charged, where waiting would have lost the Workhorse mid-step (a recovery, charged).
Before any estimate (the first step) the step is waited for.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Awaitable

log = logging.getLogger(__name__)
POLL_S = 0.2
"""How often the inbox is read during a step."""
STEPS_SEEN = 5
"""Steps whose durations estimate the next one's."""
SAFE_SHARE = 0.5
"""A step whose expected rest is at most this share of the grace is waited for."""


class StepAborted(Exception):
    """A step aborted for drain notices it would not have outlived."""

    def __init__(self, notices: list[tuple[str, int, int]], elapsed_s: float, expected_s: float):
        super().__init__(f"step aborted {elapsed_s:.1f} s in (expected {expected_s:.1f} s) for drain notices {notices}")
        self.notices, self.elapsed_s, self.expected_s = notices, elapsed_s, expected_s


class StepDrains:
    """The drain notices of one synchronous run, read during and between its steps."""

    def __init__(self, inbox: Any, grace_s: float):
        self.inbox, self.grace_s = inbox, grace_s
        self.steps_s: deque[float] = deque(maxlen=STEPS_SEEN)
        self.pending: list[tuple[str, int, int]] = []
        """Notices read during a step that was not aborted: the step boundary replaces their models."""

    def expected_s(self) -> float | None:
        """The next step's duration as the longest of the last steps (None before any)."""
        return max(self.steps_s, default=None)

    def abort_now(self, elapsed_s: float) -> bool:
        """Whether a step `elapsed_s` in should be aborted for a drain notice (see the module docstring)."""
        expected = self.expected_s()
        return expected is not None and expected - elapsed_s > SAFE_SHARE * self.grace_s

    async def run(self, step: Awaitable) -> Any:
        """The step's result, the inbox read meanwhile; `StepAborted` (the step cancelled) when a
        notice comes that the step would not outlive."""
        task = asyncio.ensure_future(step)
        t0 = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=POLL_S)
                if done:
                    result = task.result()
                    self.steps_s.append(time.monotonic() - t0)
                    return result
                notices = await self.inbox.take.remote()
                if not notices:
                    continue
                self.pending += notices
                elapsed = time.monotonic() - t0
                if self.abort_now(elapsed):
                    raise StepAborted(self.take_pending(), elapsed, self.expected_s())
                log.warning("drain notice during the step, %.1f s in: its end (expected %.1f s) is within the "
                            "%.0f s grace; replacing after it", elapsed, self.expected_s() or float("nan"),
                            self.grace_s)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def take_pending(self) -> list[tuple[str, int, int]]:
        notices, self.pending = self.pending, []
        return notices

    async def take(self) -> list[tuple[str, int, int]]:
        """At a step boundary: the notices read during the step and those since."""
        return self.take_pending() + await self.inbox.take.remote()
