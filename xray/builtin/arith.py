"""`builtin:arith`: addition of a number below 100 and a digit, `"37+5="` -> `"42"` then EOS.

Chosen for what a tiny model (a few hundred thousand parameters, character tokenizer
`xray.data.tokenizer`) learns on a CPU in seconds and PPO then visibly improves: the answer is
1 to 3 digits, and getting it right needs the units digit `(a % 10 + b) % 10` and a carry into
the tens, a rule that generalises from the 800 training prompts to the 200 held-out ones (a
plain lookup would not). Measured (single process, 344K-parameter Llama, hidden 128, 2 layers):
170 supervised steps of 64 rows at lr 1e-3 reach 0.44-0.61 greedy held-out accuracy, and 40
PPO steps of 128 rollouts (lr 1e-4, 2 epochs, kl_coef 0.01) add 0.12 to 0.27.

The 1000 pairs are shuffled with a fixed seed and split: the first `eval_size` are held out.
Rows are `{"prompt": "37+5=", "answer": "42"}`; `xray.rewards.builtin:exact_answer` scores them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from xray.builtin.tasks import TaskError, TaskFiles, write_splits


@dataclass(frozen=True)
class ArithTask:
    """Sums `a + b` with `0 <= a <= max_a`, `0 <= b <= max_b`."""

    name: str = "arith"
    """The task's name (`builtin:arith`)."""
    max_a: int = 99
    """Largest first operand."""
    max_b: int = 9
    """Largest second operand."""
    seed: int = 0
    """Seed of the shuffle that splits train from eval (fixed: the eval set never changes)."""
    reward_function: str = "xray.rewards.builtin:exact_answer"
    """Scores a completion 1.0 when its number equals `answer`."""
    answer_field: str = "answer"
    """The column with the reference answer."""

    def rows(self) -> list[dict[str, str]]:
        """Every (prompt, answer) pair, in the seeded order."""
        pairs = [(a, b) for a in range(self.max_a + 1) for b in range(self.max_b + 1)]
        random.Random(self.seed).shuffle(pairs)
        return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]

    def splits(self, eval_size: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """(train rows, eval rows): disjoint, eval is the first `eval_size` of `rows()`."""
        rows = self.rows()
        if not 0 < eval_size < len(rows):
            raise TaskError(f"builtin:{self.name} has {len(rows)} prompts; data.eval_size={eval_size} must be "
                            f"between 1 and {len(rows) - 1}")
        return rows[eval_size:], rows[:eval_size]

    def write(self, directory: Path, eval_size: int) -> TaskFiles:
        return write_splits(directory, self.name, self.rows(), eval_size)


ARITH = ArithTask()
ARITH_SMALL = ArithTask(name="arith_small", max_a=19)
"""`builtin:arith_small`: the 200 sums below 29 (hold out 50, `data.eval_size=50`). PPO drives
the tiny model to nearly always right and nearly deterministic here: the regime where a late
update can undo what was learned (`benchmarks/ppo_stability.py`)."""
