"""What every step of an RL run shares below the step itself: the phase timer that names where a
step failed (recovery reads it, `xray/run/recovery/recover.py`) and the rollout's sampling settings
for a call (seeded by the step, so a resumed run repeats the same numbers). The synchronous step
(`xray/run/step.py`), the asynchronous makers (`xray/run/detached/maker.py`) and the episode makers
use them.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any


class PhaseTimer:
    """Seconds per phase of one step (`time/<phase>_s`); an exception leaving a phase carries the
    phase's name (`exc.phase`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        except Exception as exc:
            if not hasattr(exc, "phase"):
                exc.phase = phase  # where the step failed: recovery (xray.run.recovery.recover) asks
            raise
        key = f"time/{phase}_s"  # a phase run twice in a step (dynamic sampling's rounds) adds up
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0


def rollout_sampling(cfg, stop_ids: list[int], step: int, greedy: bool = False) -> dict[str, Any]:
    """The generation engine's sampling settings for call `step` (seeded by it): the `rollout`
    section's, or one greedy response (the sync check's; evaluations: `xray.run.evaluate`). `cfg`:
    the run's `RunConfig`; `stop_ids`: the model's end-of-sequence ids
    (`xray.data.stops.stop_token_ids`), with `rollout.stop`'s strings."""
    r = cfg.rollout
    sampling = dict(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.max_new_tokens, n=1 if greedy else r.n_samples,
                    stop_token_ids=stop_ids, seed=cfg.seed * 100003 + step)
    if r.stop:
        sampling["stop"] = list(r.stop)
    return sampling
