"""The `wandb` metric logger: a Weights & Biases run with the resolved config and every numeric
metric per step; part of `xray.run.loggers`. Needs `pip install 'wandb>=0.31'` (the extra
`xray[wandb]`).

Offline unless the user configured W&B (WANDB_MODE or WANDB_API_KEY set; then W&B's own
settings decide): the run's files go under RUN_DIR/wandb, and `wandb sync RUN_DIR/wandb/offline-run-*`
uploads them later. Project: $WANDB_PROJECT, else `xray`; run name: the run directory's name.
W&B's own console lines and console capture are off: xray logs one line saying where the run is.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from xray.run.loggers.registry import FAILED, numeric

log = logging.getLogger(__name__)
WANDB_DIR = "wandb"
"""W&B's directory under the run directory (W&B names it so itself)."""


def wandb_mode() -> str | None:
    """`offline` unless the user configured W&B (then None: W&B's own settings decide)."""
    return None if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY") else "offline"


class WandbLogger:
    def __init__(self, run_dir: Path):
        import wandb

        self.wandb, self.run_dir, self.run, self.last_step = wandb, Path(run_dir), None, None

    def _start(self, config: dict[str, Any] | None) -> None:
        mode = wandb_mode()
        self.run = self.wandb.init(dir=str(self.run_dir), mode=mode, project=os.environ.get("WANDB_PROJECT", "xray"),
                                   name=self.run_dir.name, config=config,
                                   settings=self.wandb.Settings(silent=True, console="off"))
        where = f"offline in {Path(self.run.dir).parent}; upload it with `wandb sync` on that directory" \
            if mode == "offline" else f"at {self.run.url}"
        log.info("W&B run %s", where)

    def log_config(self, config: dict[str, Any]) -> None:
        if self.run is None:
            self._start(config)
        else:
            self.run.config.update(config, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.run is None:
            self._start(None)
        if self.last_step is not None and step <= self.last_step:  # a recovered run repeats steps; W&B's only go up
            log.debug("W&B keeps step %d as first logged; its repeat is in metrics.jsonl", step)
            return
        self.run.log(numeric(metrics), step=step)
        self.last_step = step

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if status == FAILED else 0)
            self.run = None
