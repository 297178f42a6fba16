"""The `tensorboard` metric logger: TensorBoard event files in RUN_DIR/tensorboard, one scalar
per numeric metric and step, and the resolved config as the text `config` (YAML); part of
`xray.run.loggers`. `tensorboard --logdir RUN_DIR/tensorboard` shows them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from xray.run.loggers.registry import numeric

TENSORBOARD_DIR = "tensorboard"
CONFIG_TAG = "config"


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR))

    def log_config(self, config: dict[str, Any]) -> None:
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text(CONFIG_TAG, "\n".join("    " + line for line in text.splitlines()), 0)
        self.writer.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in numeric(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()
