"""The `mlflow` metric logger: an MLflow run with the resolved config as parameters (dotted
keys, `ppo.kl_coef`) and every numeric metric per step; part of `xray.run.loggers`. Needs
`pip install 'mlflow-skinny>=3.17'` (the extra `xray[mlflow]`; a full `mlflow` works as well).

Tracking: $MLFLOW_TRACKING_URI when set, else a local file store in RUN_DIR/mlruns (a `file:`
URI; the full `mlflow` package's `mlflow ui --backend-store-uri RUN_DIR/mlruns` shows it).
MLflow 3 keeps its file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE=true, which this
logger sets for that store; no server is needed. Experiment: $MLFLOW_EXPERIMENT_NAME, else `xray`;
run name: the run directory's name. The client API is used, never MLflow's process-wide "active
run".
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from xray.run.loggers.registry import numeric

MLRUNS_DIR = "mlruns"
MAX_PARAM_CHARS = 6000
"""MLflow's limit on one parameter's value."""
BATCH = 100
"""Parameters or metrics per `log_batch` call (MLflow's limit on parameters)."""


def tracking_uri(run_dir: Path) -> str:
    """$MLFLOW_TRACKING_URI, else the file store RUN_DIR/mlruns (allowed for this process)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (Path(run_dir) / MLRUNS_DIR).resolve().as_uri()


def flat_params(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: value text}."""
    if isinstance(config, dict):
        out: dict[str, str] = {}
        for k, v in config.items():
            out.update(flat_params(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): str(config)[:MAX_PARAM_CHARS]}


class MlflowLogger:
    def __init__(self, run_dir: Path):
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir)
        self.client = MlflowClient(tracking_uri=tracking_uri(run_dir))
        self.run_id: str | None = None

    def _start(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "xray")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
        return self.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self.run_id or self._start()
        params = [Param(k, v) for k, v in flat_params(config).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(run_id, params=params[i:i + BATCH])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        run_id = self.run_id or self._start()
        now = int(time.time() * 1000)
        values = [Metric(k, v, now, step) for k, v in numeric(metrics).items()]
        for i in range(0, len(values), BATCH):
            self.client.log_batch(run_id, metrics=values[i:i + BATCH])

    def close(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status)
            self.run_id = None
