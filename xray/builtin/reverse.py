"""`builtin:reverse`: a three-digit number's digits backwards, `"472>"` -> `"274"` then EOS.

The task where PPO drives the tiny model to nearly always right and nearly deterministic on
held-out prompts too (`benchmarks/ppo_stability.py`): the rule (read the prompt's digits from
the end) generalises from the 700 training numbers to the 200 held out, unlike `arith_small`,
whose held-out sums a 150-prompt training set does not teach. Numbers 100 to 999, shuffled with a
fixed seed; the first `eval_size` are held out. Rows are `{"prompt": "472>", "answer": "274"}`
(leading zeros kept: `"390>"` -> `"093"`); `xray.rewards.builtin:exact_answer` scores them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from xray.builtin.tasks import TaskFiles, write_splits


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
        return write_splits(directory, self.name, self.rows(), eval_size)


REVERSE = ReverseTask()
