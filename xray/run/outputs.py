"""A run's output directory: resolved config, metrics, checkpoints, and the final model.

    <output-dir>/
      config.yaml                 the resolved config the run used
      metrics.jsonl               one JSON object per logged step
      tensorboard/                the same metrics as TensorBoard events
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
from typing import Any

import yaml

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"


class RunDir:
    """Paths and writers of one run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self._tb = None

    def write_config(self, plain: dict) -> None:
        (self.path / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path / "tensorboard"))
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def write_evals(self, before: float, after: float, step: int) -> None:
        """The evaluations before and after training (the latter after step `step`)."""
        (self.path / EVAL_FILE).write_text(json.dumps({"eval_before": before, "eval_after": after, "step": step}))

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.checkpoints.glob("step-*") if (p / "trainer_state.json").is_file())
        return done[-1] if done else None

    def write_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        tmp = directory / "trainer_state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(directory / "trainer_state.json")  # written last: marks the checkpoint complete

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer_state.json").read_text())
