"""`builtin:reverse`: a three-digit number's digits backwards, `"472>"` -> `"274"` then EOS.

The task where PPO drives the tiny model to nearly always right and nearly deterministic on
held-out prompts too (`benchmarks/ppo_stability.py`): the rule (read the prompt's digits from
the end) generalises from the 700 training numbers to the 200 held out, unlike `arith_small`,
whose held-out sums a 150-prompt training set does not teach. Numbers 100 to 999, shuffled with a
fixed seed; the first `eval_size` are held out. Rows are `{"prompt": "472>", "answer": "274"}`
(leading zeros kept: `"390>"` -> `"093"`); `xray.rewards.builtin:exact_answer` scores them.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from xray.tasks import TaskError, TaskFiles


@dataclass(frozen=True)
class ReverseTask:
    """Reverse the digits of every number in [low, high]."""

    name: str = "reverse"
    low: int = 100
    high: int = 999
    seed: int = 0
    """Seed of the shuffle that splits train from eval (fixed: the eval set never changes)."""
    reward_function: str = "xray.rewards.builtin:exact_answer"
    answer_field: str = "answer"

    def rows(self) -> list[dict[str, str]]:
        numbers = list(range(self.low, self.high + 1))
        random.Random(self.seed).shuffle(numbers)
        return [{"prompt": f"{n}>", "answer": str(n)[::-1]} for n in numbers]

    def write(self, directory: Path, eval_size: int) -> TaskFiles:
        rows = self.rows()
        if not 0 < eval_size < len(rows):
            raise TaskError(f"builtin:{self.name} has {len(rows)} prompts; data.eval_size={eval_size} must be "
                            f"between 1 and {len(rows) - 1}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = TaskFiles(directory / f"{self.name}-train.jsonl", directory / f"{self.name}-eval.jsonl")
        for path, part in ((files.train, rows[eval_size:]), (files.eval, rows[:eval_size])):
            path.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
        return files


REVERSE = ReverseTask()
