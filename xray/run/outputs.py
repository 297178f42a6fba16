"""A run's output directory: resolved config, metrics, checkpoints, and the final model.

    <output-dir>/
      config.yaml                 the resolved config the run used
      metrics.jsonl               one JSON object per logged step      } the loggers of
      tensorboard/                the same metrics as TensorBoard events } trainer.loggers
      wandb/  mlruns/             W&B offline run, MLflow file store   } (`xray.run.loggers`)
      checkpoints/step-000010/    actor/ critic/ (each Workhorse's shard) + trainer_state.json;
                                  the newest `trainer.keep_last` complete ones are kept
                                  (`RunDir.prune_checkpoints`); `python -m xray.export` turns
                                  one into a Hugging Face directory
      final/actor/                the trained actor as a Hugging Face directory
                                  (`xray.backends.hf_dir.save_hf_model`)
      eval.json                   the evaluations before and after training (`write_evals`)
      evals/step-000010.jsonl     each evaluation's responses with their rewards (`eval.samples_file`,
                                  `xray.run.evaluate`; step-000000: before training)
      rollouts.jsonl              a few of each step's responses, rewards and advantages
                                  (`trainer.log_rollouts`, `xray.run.rollout_log`)
      timeline.json               one step's busy intervals per role and rank, a Chrome trace
                                  (`xray.run.timeline`)
      report/index.html           the run report and its plots (`python -m xray.report`)
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

import yaml

from xray.run.loggers import DEFAULT_LOGGERS, MetricLoggers

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
EVALS_DIR = "evals"
"""Each evaluation's responses, one file per evaluation (`RunDir.eval_samples_path`)."""
ROLLOUTS_FILE = "rollouts.jsonl"
TRAINER_STATE = "trainer_state.json"
"""Written last into a checkpoint directory: the marker of a complete checkpoint."""
_STEP_DIR = re.compile(r"step-(\d+)")


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

    def eval_samples_path(self, step: int) -> Path:
        """`evals/step-<step>.jsonl`: the responses of the evaluation after `step` steps."""
        return self.path / EVALS_DIR / f"step-{step:06d}.jsonl"

    @property
    def rollouts_path(self) -> Path:
        return self.path / ROLLOUTS_FILE

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def complete_checkpoints(self) -> list[Path]:
        """The complete checkpoint directories (their `trainer_state.json` written), oldest first."""
        done = [(int(m.group(1)), p) for p in self.checkpoints.glob("step-*")
                if (m := _STEP_DIR.fullmatch(p.name)) and (p / TRAINER_STATE).is_file()]
        return [p for _, p in sorted(done)]

    def latest_checkpoint(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def prune_checkpoints(self, keep_last: int, keep: tuple[Path, ...] = ()) -> list[Path]:
        """Delete the complete checkpoints older than the newest `keep_last` (0: keep all), except
        those in `keep`; returns them. The newest complete one (what a resume or a recovery loads)
        always stays, and so does any directory not complete yet (being written, or abandoned by
        a crash: the run writes it again). Each loses its marker first: one half deleted by a
        crash is never taken for complete."""
        if keep_last <= 0:
            return []
        kept = {Path(k).resolve() for k in keep}
        old = [p for p in self.complete_checkpoints()[:-keep_last] if p.resolve() not in kept]
        for path in old:
            (path / TRAINER_STATE).unlink()
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint %s deleted (trainer.keep_last=%d)", path, keep_last)
        return old

    def write_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        tmp = directory / (TRAINER_STATE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(directory / TRAINER_STATE)  # written last: marks the checkpoint complete

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    def close(self, error: BaseException | None = None) -> None:
        """Close the loggers, telling them whether the run finished, failed (`error`) or was stopped."""
        self.loggers.close(error)


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / TRAINER_STATE).read_text())
