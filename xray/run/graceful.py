"""Graceful exit: SIGTERM or SIGINT to the driver ends the run at a step boundary, resumable.

`GracefulStop` installs the handlers on the run's event loop. The loop asks `requested` before
each step and runs each step through `guard`: a step under way when the signal comes may finish
within `trainer.exit_grace_s` seconds (`trainer.on_signal: finish`; left null, sized to the step:
1.5 times the longest of the last 5 steps `guard` ran, at least 10 s), after which it is abandoned;
with `on_signal: abandon` it is cancelled at once. The algorithm then takes a flash checkpoint of
the last finished step (not after an abandoned one: the models may be mid-update, so the last
complete checkpoint stands), waits until it is on disk, and raises `RunInterrupted`, which
`python -m xray.train` turns into exit status 0 and the `--resume` command.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from typing import Any, Awaitable

log = logging.getLogger(__name__)

STEPS_SEEN, STEP_FACTOR, MIN_GRACE_S = 5, 1.5, 10.0
"""The grace sized to the steps: `STEP_FACTOR` x the longest of the last `STEPS_SEEN`, at least `MIN_GRACE_S`."""


class RunInterrupted(Exception):
    """The run stopped on a signal after saving; `resume` is the command that continues it."""

    def __init__(self, step: int, resume: str):
        super().__init__(f"stopped on a signal at step {step}; continue with: {resume}")
        self.step, self.resume = step, resume


class GracefulStop:
    """Signal handling for one run's event loop."""

    def __init__(self, on_signal: str = "finish", grace_s: float | None = 10.0):
        self.fixed_s = 0.0 if on_signal == "abandon" else grace_s
        """The grace given; None: sized to the steps (`grace_s`)."""
        self.steps_s: deque[float] = deque(maxlen=STEPS_SEEN)
        """The durations of the last steps `guard` ran to their end."""
        self.event = asyncio.Event()
        self.abandoned = False
        self.signal: str | None = None

    @property
    def grace_s(self) -> float:
        """Seconds the step under way may still take after a signal."""
        if self.fixed_s is not None:
            return self.fixed_s
        return max(MIN_GRACE_S, STEP_FACTOR * max(self.steps_s, default=0.0))

    def install(self) -> "GracefulStop":
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.event.is_set():  # a second signal: stop waiting for the step
            self.fixed_s = 0.0
        self.signal = sig.name
        log.warning("%s received: stopping at the end of this step (within %.0f s), then saving", sig.name, self.grace_s)
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    async def guard(self, step: Awaitable) -> Any:
        """The step's result; `None` when a signal came and the step did not finish in the grace time
        (it is cancelled, and `abandoned` is set)."""
        task = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self.event.wait())
        t0 = time.monotonic()
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled() and task.exception() is None:
                self.steps_s.append(time.monotonic() - t0)
            if not task.done():
                await asyncio.wait([task], timeout=self.grace_s)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.abandoned = True
                log.warning("the step under way was abandoned; the run resumes from its last complete checkpoint")
                return None
            return task.result()
        finally:
            stop.cancel()
