"""A run's output directory: resolved config, metrics, checkpoints, and the final model.

    <output-dir>/
      config.yaml                 the resolved config the run used
      metrics.jsonl               one JSON object per logged step      } the loggers of
      tensorboard/                the same metrics as TensorBoard events } trainer.loggers
      wandb/  mlruns/             W&B offline run, MLflow file store   } (`xray.run.loggers`)
      checkpoints/step-000010/    actor/ critic/ (each Workhorse's shard) + trainer_state.json
      final/actor/                the trained actor as a Hugging Face directory
                                  (`xray.backends.hf_dir.save_hf_model`)
      eval.json                   the evaluations before and after training (`write_evals`)
      timeline.json               one step's busy intervals per role and rank, a Chrome trace
                                  (`xray.run.timeline`)
      report/index.html           the run report and its plots (`python -m xray.report`)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import yaml

from xray.run.loggers import DEFAULT_LOGGERS, MetricLoggers

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"


class RunDir:
    """Paths and writers of one run; its metrics go to the metric loggers `loggers`
    (`trainer.loggers`; a missing optional package fails here, before anything starts)."""

    def __init__(self, path: str | Path, loggers: Sequence[str] = DEFAULT_LOGGERS):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.loggers = MetricLoggers(self.path, loggers)

    def write_config(self, plain: dict) -> None:
        """config.yaml, and the run's hyper-parameters in every logger."""
        (self.path / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
        self.loggers.log_config(plain)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.loggers.log(step, metrics)

    def write_evals(self, before: float, after: float, step: int, details: dict | None = None) -> None:
        """The evaluations before and after training (the latter after step `step`), with `details`
        (an episode run's: its episodes' metrics at each)."""
        (self.path / EVAL_FILE).write_text(json.dumps({"eval_before": before, "eval_after": after, "step": step,
                                                       **(details or {})}))

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoints.glob("step-*") if (p / "trainer_state.json").is_file())
        return done[-1] if done else None

    def write_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        tmp = directory / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(directory / "trainer_state.json")  # written last: marks the checkpoint complete

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    def close(self, error: BaseException | None = None) -> None:
        """Close the loggers, telling them whether the run finished, failed (`error`) or was stopped."""
        self.loggers.close(error)


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer_state.json").read_text())
