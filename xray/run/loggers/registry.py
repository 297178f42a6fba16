"""The metric loggers a run can name (`trainer.loggers`), the packages they need, and how each
opens; part of `xray.run.loggers`. `check_loggers` runs before anything starts (the command
line's config check, and `MetricLoggers`), so a missing optional package is one line that says
the pip command, never a failure after the models are up.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol

from xray.config.typed import ConfigError

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"
"""How a run ended, as each logger is told when it closes (MLflow's own run statuses)."""


class MetricLogger(Protocol):
    """One destination of a run's metrics."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the resolved config (the run's hyper-parameters)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics."""

    def close(self, status: str) -> None:
        """Flush and end the run: `FINISHED`, `FAILED` or `KILLED` (stopped by a signal)."""


@dataclass(frozen=True)
class LoggerSpec:
    """A logger: the class that implements it and the optional package it imports."""

    implementation: str
    """`module:Class` under `xray.run.loggers`, imported only when the logger opens."""
    module: Optional[str] = None
    """The top-level module it needs (None: nothing beyond xray's own dependencies)."""
    install: Optional[str] = None
    """The pip command that installs that module."""


LOGGERS = {
    "jsonl": LoggerSpec("xray.run.loggers.jsonl_file:JsonlLogger"),
    "tensorboard": LoggerSpec("xray.run.loggers.tensorboard_events:TensorBoardLogger", "tensorboard",
                              "pip install tensorboard"),
    "wandb": LoggerSpec("xray.run.loggers.wandb_run:WandbLogger", "wandb", "pip install 'wandb>=0.31'"),
    "mlflow": LoggerSpec("xray.run.loggers.mlflow_run:MlflowLogger", "mlflow", "pip install 'mlflow-skinny>=3.17'"),
}
"""Every logger by the name `trainer.loggers` gives it."""
DEFAULT_LOGGERS = ("jsonl", "tensorboard")


class LoggerUnavailable(ConfigError):
    """A configured logger cannot run here; the message says the fix."""


def check_loggers(names: Iterable[str]) -> None:
    """Raise `LoggerUnavailable` when a name is unknown or repeated, or its package is missing."""
    seen: set[str] = set()
    for name in names:
        if name not in LOGGERS:
            raise LoggerUnavailable(f"trainer.loggers: unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
        if name in seen:
            raise LoggerUnavailable(f"trainer.loggers lists {name!r} twice; list each logger once")
        seen.add(name)
        spec = LOGGERS[name]
        if spec.module and importlib.util.find_spec(spec.module) is None:
            raise LoggerUnavailable(f"trainer.loggers names {name!r}, but its package {spec.module!r} is not "
                                    f"installed: `{spec.install}`, or remove {name!r} from trainer.loggers")


def open_logger(name: str, run_dir: Path) -> MetricLogger:
    """A new logger `name` writing for the run in `run_dir`."""
    check_loggers([name])
    module, cls = LOGGERS[name].implementation.split(":")
    return getattr(importlib.import_module(module), cls)(run_dir)


def end_status(error: BaseException | None) -> str:
    """`FINISHED` without an error, `KILLED` for a signal's stop, else `FAILED`."""
    from xray.run.graceful import RunInterrupted

    if error is None:
        return FINISHED
    return KILLED if isinstance(error, (KeyboardInterrupt, RunInterrupted)) else FAILED


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a number-only logger takes (bools and non-numbers left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
