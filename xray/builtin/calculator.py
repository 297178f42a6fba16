"""`builtin:calculator` as a data task: multi-digit arithmetic prompts the built-in model answers by
calling the calculator tool, with the tool-use demonstrations its warm start trains on.

The prompts, the environment that plays them (`env.name: builtin:calculator`) and the solved
episodes are `xray/env/tasks.py`'s; this module makes them a task of `data.path` (its train and
held-out files, `xray/builtin/tasks.py`) and gives the warm start (`algorithms/warm_start.py`)
demonstrations instead of (prompt, answer) pairs: half of them whole tool-use episodes (prompt,
call, the tool's answer, final answer; the loss on the model's turns only), half the answer at
once, which the model cannot compute: it starts calling the tool on about half the prompts, and
RL (whose tool-using episodes earn the reward) has to raise that share. `configs/grpo_calculator_cpu.yaml` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xray.builtin.tasks import TaskFiles, write_splits


@dataclass(frozen=True)
class CalculatorDataTask:
    """The calculator task's rows: `count` seeded prompts, `q: 4821*37=?` with `answer`, `expression`."""

    name: str = "calculator"
    count: int = 2000
    seed: int = 0
    reward_function: str = "xray.rewards.builtin:exact_answer"
    """A single-completion run's score (a run with `env.name: builtin:calculator` is scored by it)."""
    answer_field: str = "answer"
    tool_demonstrations: float = 0.5
    """The share of warm-start demonstrations that use the tool; the others answer at once (the
    model cannot compute the answer in its head: RL has to move it to the tool)."""

    def rows(self) -> list[dict[str, str]]:
        from xray.env.tasks import CalculatorTask

        return CalculatorTask().rows(self.count, self.seed)

    def write(self, directory: Path, eval_size: int) -> TaskFiles:
        return write_splits(directory, self.name, self.rows(), eval_size)

    def demonstrations(self, prompts: list, extras: dict[str, list], tokenizer: Any, chat: Any = None) -> list[tuple]:
        """(prompt ids, the rest's ids, its loss mask) of each row: solved with one calculator call
        (a seeded `tool_demonstrations` share of them), or answered at once; in the chat format of
        `chat` (a `ChatFormat`, the run's `data` settings; None: the tokenizer's own template, if any)."""
        import random

        from xray.data.chat import ChatFormat
        from xray.env.tasks import demonstration_ids

        rng, out = random.Random(self.seed + 1), []
        for i, prompt in enumerate(prompts):
            row = {"prompt": prompt, "answer": extras["answer"][i], "expression": extras["expression"][i]}
            ids, mask = demonstration_ids(row, tokenizer, chat=chat or ChatFormat())
            start = mask.index(1)
            if rng.random() >= self.tool_demonstrations:  # the prompt, then the answer and end-of-sequence
                answer = list(tokenizer(str(row["answer"]), add_special_tokens=False).input_ids)
                answer.append(int(tokenizer.eos_token_id))
                out.append((ids[:start], answer, [1] * len(answer)))
            else:
                out.append((ids[:start], ids[start:], mask[start:]))
        return out


CALCULATOR = CalculatorDataTask()
