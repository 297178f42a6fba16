"""Where a run's train and eval rows come from: `data.path` (a user's data, or `builtin:<name>`)
and the eval set (`data.eval_path`, `data.eval_split`, or rows held out of `data.path`). A built-in
task writes its train and held-out splits as JSONL files under the run's directory, which are then
read as a user's files are. `xray/data` reads files and knows no task; this module, one layer
above it beside the task registry (`xray.builtin.tasks`), resolves the `builtin:` names and the
eval set for every command that reads `data.path`.

The eval set, when the config names none, is a seeded random sample of `data.eval_size` rows of
`data.path` (`data.eval_seed`), left out of training; with `data.eval_path` or `data.eval_split` it
is a seeded sample of that many of the named rows, and `data.path` is trained on whole.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Optional, TypeVar

from xray.builtin.tasks import get_task, is_builtin
from xray.config.data import DataConfig
from xray.data.chat import ChatFormat
from xray.data.files import DataFileError, Rows, Source, read_rows
from xray.data.prompts import PromptDataError, PromptSet, load_prompts
from xray.data.text import file_documents

Split = TypeVar("Split", Rows, PromptSet)


def load_prompt_splits(config: DataConfig, tokenizer, workdir: str | Path) -> tuple[PromptSet, PromptSet]:
    """Train and eval prompts, tokenised under the config's chat settings (`load_prompts`); see the
    module docstring."""
    kwargs = dict(prompt_field=config.prompt_field, max_prompt_tokens=config.max_prompt_tokens,
                  on_long_prompt=config.on_long_prompt, chat=ChatFormat.of(config))

    def encode(rows: Rows) -> PromptSet:
        return load_prompts(rows, tokenizer, **kwargs) if len(rows) else PromptSet([], [], where=[])

    return _splits(config, workdir, encode)


def load_row_splits(config: DataConfig, workdir: str | Path) -> tuple[Rows, Rows]:
    """Train and eval rows as read, not tokenised, by the same rules as `load_prompt_splits` (whose
    default hold-out is drawn from the prompts `data.on_long_prompt` kept; this one's from every
    row): supervised conversations are rendered from them (`algorithms.sft`)."""
    return _splits(config, workdir, lambda rows: rows)


def _splits(config: DataConfig, workdir: str | Path, encode: Callable[[Rows], Split]) -> tuple[Split, Split]:
    if is_builtin(config.path):
        set_ = [k for k, v in (("data.split", config.split != "train"), ("data.eval_path", config.eval_path),
                               ("data.eval_split", config.eval_split)) if v]
        if set_:
            raise PromptDataError(f"{config.path} writes its own train and eval splits (data.eval_size eval rows); "
                                  f"leave {' and '.join(set_)} at the default, or give your own data in data.path")
        files = get_task(config.path).write(Path(workdir), eval_size=config.eval_size)
        return encode(_rows(files.train, None, "data.path")), encode(_rows(files.eval, None, "data.path"))
    train = _rows(config.path, config.split, "data.path", "data.split")
    if config.eval_path or config.eval_split:
        if not config.eval_path and config.eval_split == config.split:
            raise PromptDataError(f"data.eval_split={config.eval_split!r} is the split trained on (data.split); "
                                  "evaluate on another split, or leave data.eval_split empty to hold rows out")
        source = config.eval_path or config.path
        key = "data.eval_path" if config.eval_path else "data.path"
        held = _rows(source, config.eval_split or None, key, "data.eval_split")
        return encode(train), encode(held.select(eval_sample(len(held), config.eval_size, config.eval_seed, key)))
    whole = encode(train)
    keep, out = hold_out(len(whole), config.eval_size, config.eval_seed, str(train))
    return whole.select(keep), whole.select(out)


def _rows(source: Source, split: Optional[str], key: str, split_key: str = "") -> Rows:
    """The rows of `source`; a read error names the config key that chose it."""
    try:
        rows, where = read_rows(source, split)
    except DataFileError as exc:
        keys = f"{key} / {split_key}" if split_key and split is not None else key
        raise DataFileError(f"{keys}: {exc}") from None
    return Rows(rows, where, str(source))


def hold_out(n: int, eval_size: int, seed: int, name: str) -> tuple[list[int], list[int]]:
    """(train, eval) row indices, each in file order: a seeded random `eval_size` of `n` rows for
    evaluation, the rest for training."""
    if eval_size < 0 or eval_size >= n:
        raise PromptDataError(f"{name} has {n} rows, too few to hold out data.eval_size={eval_size} for "
                              f"evaluation and train on the rest; set data.eval_size below {n}, or name the eval "
                              "rows with data.eval_path or data.eval_split")
    out = sorted(random.Random(seed).sample(range(n), eval_size))
    held = set(out)
    return [i for i in range(n) if i not in held], out


def eval_sample(n: int, eval_size: int, seed: int, key: str) -> list[int]:
    """Indices, in file order, of a seeded `eval_size` of the `n` rows of a named eval set (all of
    them when `eval_size` is `n`)."""
    if eval_size < 0 or eval_size > n:
        raise PromptDataError(f"the eval rows ({key}) are {n}, fewer than data.eval_size={eval_size}; set "
                              f"data.eval_size to {n} or fewer (a multiple of rollout.dp)")
    return list(range(n)) if eval_size == n else sorted(random.Random(seed).sample(range(n), eval_size))


def read_documents(path: str | list[str], text_field: str, workdir: Path, eval_size: int) -> list[str]:
    """Every document of `path` in order (`xray.data.text`): a built-in task's rows, each its prompt
    followed by its answer (the held-out split first), written under `workdir` with `eval_size`
    held out; else the files' or directory's documents (`file_documents`)."""
    if not is_builtin(path):
        return file_documents(path, text_field)
    task = get_task(path)
    files = task.write(Path(workdir), eval_size)
    rows = [json.loads(line) for f in (files.eval, files.train) for line in f.read_text().splitlines() if line]
    return [f"{r['prompt']}{r[task.answer_field]}" for r in rows]
