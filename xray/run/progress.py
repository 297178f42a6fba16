"""The one progress line of an RL run (`python -m xray.train ppo`, `grpo`, `rloo`, `reinforce_pp`).

    ppo (sync):  40%|████      | 32/80 [00:41<01:02,  1.30s/step, reward 0.512 | eval 0.430 |
                 kl 0.0123 | 49 samples/s | 0.65 s/step | sync ok 2.4e-07]          (one line)

After each step: the step's mean reward, the latest held-out evaluation (before training, then
each `trainer.eval_every`), the KL to the reference, samples and seconds per step (the step's
phases, `time/*`, without checkpoints and evaluations; async runs, which time no phases, the wall
clock between steps), and
the last weight-sync check: `ok` with the largest log-prob difference the probe saw (a failed
check ends the run with an error instead), `unverified` when `sync.verify` is off. Async runs
add the experience's staleness. The figures are also in the run's metrics (`xray.run.loggers`).

While the bar is up, log lines are written above it (tqdm's logging redirect), never through it.
`--quiet` turns the bar off (`xray.run.console`).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Optional

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from xray.run.console import progress_shown

SYNC_DIFF = "sync/max_abs_logprob_diff"


def sync_text(diff: Optional[float]) -> Optional[str]:
    """The last sync check as shown: None before any, `unverified`, or `ok <max diff>`."""
    if diff is None:
        return None
    return "unverified" if math.isnan(diff) else f"ok {diff:.1e}"


def progress_text(metrics: dict[str, Any], samples_per_step: int, eval_score: Optional[float],
                  sync: Optional[str], wall_s: float = 0.0) -> str:
    """The figures after the bar for one step's `metrics` (`wall_s`: the seconds since the last
    step, for a step that times no phases)."""
    seconds = sum(v for k, v in metrics.items() if k.startswith("time/")) or wall_s
    samples_per_s = metrics.get("samples_per_s", samples_per_step / seconds if seconds > 0 else float("nan"))
    parts = [f"reward {metrics['reward/mean']:.3f}"]
    if eval_score is not None:
        parts.append(f"eval {eval_score:.3f}")
    if "kl" in metrics or "distill/reverse_kl" not in metrics:
        parts.append(f"kl {metrics.get('kl', 0.0):.4f}")
    if "distill/reverse_kl" in metrics:  # on-policy distillation: KL(student || teacher)
        parts.append(f"teacher kl {metrics['distill/reverse_kl']:.4f}")
    parts.append(f"{samples_per_s:.0f} samples/s")
    if seconds > 0:
        parts.append(f"{seconds:.2f} s/step")
    if "async/staleness" in metrics:
        parts.append(f"staleness {metrics['async/staleness']:.0f}")
    if sync is not None:
        parts.append(f"sync {sync}")
    return " | ".join(parts)


class StepProgress:
    """The progress bar over `steps` (a range of step numbers); a context manager."""

    def __init__(self, steps: range, desc: str, samples_per_step: int, eval_before: Optional[float] = None):
        self.bar = tqdm(total=len(steps), desc=desc, unit="step", file=sys.stderr, mininterval=1.0,
                        dynamic_ncols=True, disable=not progress_shown())
        self.samples_per_step, self.eval, self.sync = samples_per_step, eval_before, None
        self.last = time.perf_counter()
        self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])

    def __enter__(self) -> "StepProgress":
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
        self._redirect.__exit__(*exc)

    def step(self, metrics: dict[str, Any]) -> None:
        """One step done, with its metrics (`eval` and the sync check when they were measured)."""
        if "eval" in metrics:
            self.eval = metrics["eval"]
        if SYNC_DIFF in metrics:
            self.sync = sync_text(metrics[SYNC_DIFF])
        now = time.perf_counter()
        wall_s, self.last = now - self.last, now
        text = progress_text(metrics, self.samples_per_step, self.eval, self.sync, wall_s)
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(1)
