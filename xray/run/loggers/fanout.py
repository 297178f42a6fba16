"""A run's open metric loggers (`trainer.loggers`): every step and the config go to each, and
all of them close at the end of the run, on success or failure; part of `xray.run.loggers`.

Each logger opens on first use (the config, or the first step), so a directory that never logs
leaves no W&B or MLflow run behind. A logger that fails to close is reported as a warning and
the others still close; the run's own error, if any, is what propagates.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

from xray.run.loggers.registry import DEFAULT_LOGGERS, MetricLogger, check_loggers, end_status, open_logger

log = logging.getLogger(__name__)


class MetricLoggers:
    """The loggers `names` of the run in `run_dir`."""

    def __init__(self, run_dir: Path, names: Sequence[str] = DEFAULT_LOGGERS):
        check_loggers(names)
        self.run_dir, self.names = Path(run_dir), tuple(names)
        self.opened: dict[str, MetricLogger] = {}

    def _each(self) -> Iterator[MetricLogger]:
        for name in self.names:
            if name not in self.opened:
                self.opened[name] = open_logger(name, self.run_dir)
            yield self.opened[name]

    def log_config(self, config: dict[str, Any]) -> None:
        for logger in self._each():
            logger.log_config(config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for logger in self._each():
            logger.log(step, metrics)

    def close(self, error: BaseException | None = None) -> None:
        """Close every opened logger, telling it how the run ended (`error`: what ended it)."""
        status = end_status(error)
        opened, self.opened = self.opened, {}
        for name, logger in opened.items():
            try:
                logger.close(status)
            except Exception as exc:  # noqa: BLE001 - one logger's failure must not hide the others or the run's
                log.warning("the %s logger did not close cleanly: %s: %s", name, type(exc).__name__, exc)
