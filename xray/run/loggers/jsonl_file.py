"""The `jsonl` metric logger: one JSON object per logged step in RUN_DIR/metrics.jsonl, every
metric as the trainer gave it; part of `xray.run.loggers`. The run report (`xray.report`) and the
tests read this file. The hyper-parameters are RUN_DIR/config.yaml, which `RunDir` always writes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlLogger:
    def __init__(self, run_dir: Path):
        from xray.run.outputs import METRICS_FILE

        self.path = Path(run_dir) / METRICS_FILE

    def log_config(self, config: dict[str, Any]) -> None:
        """Nothing: `RunDir.write_config` writes config.yaml beside the metrics."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self, status: str) -> None:
        """Nothing to flush: each step is appended and closed."""
