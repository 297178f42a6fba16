"""Reading a run directory's metrics back through each logger's own library (`trainer.loggers`,
`xray.run.loggers`). A test helper: `tests/unit/test_loggers.py` uses it on 3 logged steps, and
an end-to-end test can use it on a real run's directory.

    from tests.logger_readback import tensorboard_scalars, mlflow_metric_history, wandb_history
    assert [s for s, _ in tensorboard_scalars(run_dir, "reward/mean")] == [1, 2, 3]

Each history is `[(step, value), ...]` in step order. TensorBoard through its `EventAccumulator`,
MLflow through `MlflowClient.get_metric_history` on RUN_DIR/mlruns (a `file:` store), W&B
offline through W&B's own reader of the run's `.wandb` transaction log (`wandb leet inspect
--json`, which W&B ships for it; wandb 0.31 no longer has a Python reader of that file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def jsonl_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN_DIR/metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


# -- TensorBoard --------------------------------------------------------------------------------
def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """The scalar `tag` of RUN_DIR/tensorboard."""
    return [(e.step, e.value) for e in _accumulator(run_dir).Scalars(tag)]


def tensorboard_texts(run_dir: Path, tag: str = "config") -> list[str]:
    """Every value of the text summary `tag` of RUN_DIR/tensorboard (the run's config: `config`)."""
    from tensorboard.util import tensor_util

    events = _accumulator(run_dir).Tensors(f"{tag}/text_summary")
    return [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in events]


# -- MLflow -------------------------------------------------------------------------------------
def mlflow_client(run_dir: Path):
    """A client of the file store RUN_DIR/mlruns."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    return MlflowClient(tracking_uri=(Path(run_dir) / "mlruns").resolve().as_uri())


def mlflow_run(run_dir: Path, experiment: str = "xray"):
    """The latest MLflow run of `experiment` in RUN_DIR/mlruns (`.data.params`, `.info.status`)."""
    client = mlflow_client(run_dir)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {run_dir}/mlruns"
    runs = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    assert runs, f"no MLflow run in experiment {experiment!r} of {run_dir}/mlruns"
    return runs[0]


def mlflow_metric_history(run_dir: Path, key: str, experiment: str = "xray") -> list[tuple[int, float]]:
    """The metric `key` of the latest MLflow run in RUN_DIR/mlruns."""
    history = mlflow_client(run_dir).get_metric_history(mlflow_run(run_dir, experiment).info.run_id, key)
    return sorted((m.step, m.value) for m in history)


# -- W&B ----------------------------------------------------------------------------------------
def wandb_file(run_dir: Path) -> Path:
    """The `.wandb` transaction log of the latest W&B run under RUN_DIR/wandb."""
    found = sorted((Path(run_dir) / "wandb").glob("*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    assert found, f"no W&B run file under {run_dir}/wandb"
    return found[-1]


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the latest W&B run under RUN_DIR/wandb, as W&B's reader prints them."""
    wandb_cli = [sys.executable, "-c", "from wandb.cli.cli import cli; cli()"]
    out = subprocess.run([*wandb_cli, "leet", "inspect", "--json", str(wandb_file(run_dir))],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_history(run_dir: Path, key: str, records: list[dict] | None = None) -> list[tuple[int, float]]:
    """The metric `key` of the latest W&B run under RUN_DIR/wandb."""
    rows = [r["history"] for r in records or wandb_records(run_dir) if r.get("type") == "history"]
    return sorted((int(h["step"]["num"]), float(h["item"][key])) for h in rows if key in h.get("item", {}))


def wandb_config(run_dir: Path, records: list[dict] | None = None) -> dict[str, Any]:
    """The config (hyper-parameters) of the latest W&B run under RUN_DIR/wandb."""
    config: dict[str, Any] = {}
    for r in records or wandb_records(run_dir):
        if r.get("type") in ("run", "config"):
            update = (r.get("run", {}).get("config") or r.get("config") or {}).get("update", {})
            config.update({k: v for k, v in update.items() if k != "_wandb"})
    return config


def wandb_exit_code(run_dir: Path, records: list[dict] | None = None) -> int | None:
    """The exit code the latest W&B run under RUN_DIR/wandb finished with (None: not finished)."""
    exits = [r["exit"].get("exit_code", 0) for r in records or wandb_records(run_dir) if r.get("type") == "exit"]
    return int(exits[-1]) if exits else None
