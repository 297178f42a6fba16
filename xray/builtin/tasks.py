"""Built-in tasks with a verifiable reward, named `builtin:<name>` in `data.path`.

A task writes its train and held-out eval prompts as JSONL files, which the run then reads through
the same path as a user's data (`xray.data.prompts`), and names the reward function that scores
them. `arith` (`xray.builtin.arith`) is the default job's task; `xray.data.supervised` turns a task's
(prompt, answer) rows into a supervised warm-start batch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# name -> "module:attribute" of the task object, imported on first use
TASKS = {"arith": "xray.builtin.arith:ARITH", "arith_small": "xray.builtin.arith:ARITH_SMALL",
         "reverse": "xray.builtin.reverse:REVERSE", "calculator": "xray.builtin.calculator:CALCULATOR"}


class TaskError(ValueError):
    """An unknown built-in task or an impossible split; says what to use instead."""


@dataclass(frozen=True)
class TaskFiles:
    """The JSONL files a task wrote."""

    train: Path
    """Training prompts."""
    eval: Path
    """Held-out prompts, disjoint from `train`."""


class Task(Protocol):
    name: str
    reward_function: str
    """`module:function` that scores this task's completions (TRL convention)."""
    answer_field: str
    """The column holding the reference answer (the supervised target for a warm start)."""

    def write(self, directory: Path, eval_size: int) -> TaskFiles:
        """Write `<directory>/<name>-train.jsonl` and `-eval.jsonl` (eval_size rows) and return them."""


def write_splits(directory: Path, name: str, rows: list[dict], eval_size: int) -> TaskFiles:
    """A task's seeded `rows` as `<name>-eval.jsonl` (the first `eval_size`) and `<name>-train.jsonl`
    (the rest) under `directory`."""
    import json

    if not 0 < eval_size < len(rows):
        raise TaskError(f"builtin:{name} has {len(rows)} prompts; data.eval_size={eval_size} must be "
                        f"between 1 and {len(rows) - 1}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = TaskFiles(directory / f"{name}-train.jsonl", directory / f"{name}-eval.jsonl")
    for path, part in ((files.train, rows[eval_size:]), (files.eval, rows[:eval_size])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return files


def is_builtin(path: object) -> bool:
    """Whether `data.path` (a string, or a list of files) names a built-in task (`builtin:<name>`)."""
    return isinstance(path, str) and path.startswith("builtin:")


def get_task(path: str) -> Task:
    """The task named by `builtin:<name>` (or a bare name)."""
    name = path.split(":", 1)[1] if path.startswith("builtin:") else path
    if name not in TASKS:
        raise TaskError(f"unknown built-in task {path!r}; built-in tasks are "
                        f"{', '.join('builtin:' + n for n in TASKS)}, or give a data file or directory")
    module, attr = TASKS[name].split(":")
    return getattr(importlib.import_module(module), attr)
