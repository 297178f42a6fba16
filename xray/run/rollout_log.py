"""A sample of each training step's rollouts written as text: `rollouts.jsonl` in the run directory
(`trainer.log_rollouts` prompts' groups per step), so a user can read what the model said while
it trained.

Two halves, because in an asynchronous run the experience never reaches the driver: wherever a
step meets its scored experience and its advantages (the synchronous step, `xray/run/step.py`;
the asynchronous trainer, `xray/run/detached/trainer.py`), `pick_rollouts` keeps the token ids,
reward and advantage of the step's first groups (small, picklable); the driver's `RolloutLog`
decodes them with the run's tokenizer and appends them, one JSON object per response. A step
done again (a resume, a recovery) replaces the rows it had written.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from xray.data import columns as C
from xray.data.batch import Batch

ROLLOUT_ROWS = "rollout_rows"
"""The key under which the asynchronous trainer's step metrics carry its picked rollouts to the
driver (`xray/run/detached/supervisor.py` takes them out before the metrics are logged)."""


def pick_rollouts(exp: Batch, scores: torch.Tensor, advantages: torch.Tensor | None, mask: torch.Tensor,
                  groups: int, n_samples: int, keep: torch.Tensor | None = None) -> list[dict]:
    """The first `groups` prompts' samples of a step (`n_samples` consecutive rows each): prompt and
    response token ids, reward (None where `keep` dropped it), and advantage, the mean of
    `advantages` [B, T-1] over the response's trained tokens `mask` [B, T-1] (None without any,
    or when the algorithm gives none)."""
    rows = min(len(exp), max(0, groups) * n_samples)
    if rows == 0:
        return []
    counts = mask[:rows].sum(1)
    means = None if advantages is None else (advantages[:rows] * mask[:rows]).sum(1) / counts.clamp(min=1)
    out = []
    for i in range(rows):
        dropped = keep is not None and not bool(keep[i])
        out.append({"group": i // n_samples, "sample": i % n_samples,
                    "prompt_ids": list(map(int, exp[C.PROMPT_IDS][i])),
                    "response_ids": list(map(int, exp[C.RESPONSE_IDS][i])),
                    "reward": None if dropped else float(scores[i]),
                    "advantage": None if means is None or counts[i] == 0 else float(means[i])})
    return out


class RolloutLog:
    """`rollouts.jsonl` of one run, appended step by step on the driver; rows after `start_step`
    (the step a run starts or resumes from) are dropped first: they will be made again."""

    def __init__(self, path: Path, tokenizer, start_step: int = 0):
        self.path, self.tokenizer = Path(path), tokenizer
        self.last = start_step
        """The last step written (or started from)."""
        self.drop_from(start_step + 1)

    def write(self, step: int, picked: list[dict]) -> int:
        """Append step `step`'s `picked` rollouts (`pick_rollouts`) as text; the rows written."""
        if step <= self.last:  # a step done again (recovery): its rows, and later ones, are replaced
            self.drop_from(step)
        self.last = step
        if not picked:
            return 0
        with open(self.path, "a", encoding="utf-8") as f:
            for row in picked:
                f.write(json.dumps(self.record(step, row), ensure_ascii=False) + "\n")
        return len(picked)

    def record(self, step: int, row: dict) -> dict:
        """One line of the file: step, group, sample, prompt, completion, reward, advantage."""
        return {"step": step, "group": row["group"], "sample": row["sample"], "prompt": self.decode(row["prompt_ids"]),
                "completion": self.decode(row["response_ids"]), "reward": _finite(row["reward"]),
                "advantage": _finite(row["advantage"])}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def drop_from(self, step: int) -> None:
        """Remove the rows of step `step` and later (nothing when the file is absent)."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _step(line) < step]  # a torn last line goes too
        if len(kept) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            tmp.replace(self.path)


def _step(line: str) -> float:
    """The step of one line of the file; infinity when it is not a whole row (a crash mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _finite(value: float | None) -> float | None:
    """JSON has no NaN: a non-finite number is written as null."""
    return value if value is None or math.isfinite(value) else None
