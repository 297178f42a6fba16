"""Where a run's prompts and documents come from when `data.path` may name a built-in task
(`builtin:<name>`): the task writes its train and held-out splits as JSONL files under the run's
directory, which are then read as a user's files are. `xray/data` reads files and knows no task;
this module, one layer above it beside the task registry (`xray.builtin.tasks`), resolves the
`builtin:` names for every command that reads `data.path`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from xray.builtin.tasks import get_task
from xray.config.data import DataConfig
from xray.data.prompts import PromptDataError, PromptSet, load_prompts
from xray.data.text import file_documents


def load_prompt_splits(config: DataConfig, tokenizer, workdir: str | Path,
                       chat_template: Optional[bool] = None) -> tuple[PromptSet, PromptSet]:
    """Train and held-out eval prompts. A built-in task writes its two splits as JSONL files under
    `workdir` and they are read back through `load_prompts`; a user file keeps its last
    `config.eval_size` rows for evaluation."""
    kwargs = dict(prompt_field=config.prompt_field, max_prompt_tokens=config.max_prompt_tokens,
                  on_long_prompt=config.on_long_prompt, chat_template=chat_template)
    if config.path.startswith("builtin:"):
        files = get_task(config.path).write(Path(workdir), eval_size=config.eval_size)
        return load_prompts(files.train, tokenizer, **kwargs), load_prompts(files.eval, tokenizer, **kwargs)
    everything = load_prompts(config.path, tokenizer, **kwargs)
    n = len(everything)
    if config.eval_size < 0 or config.eval_size >= n:
        raise PromptDataError(f"{config.path} has {n} rows, too few to hold out data.eval_size={config.eval_size} "
                              f"for evaluation and train on the rest; set data.eval_size below {n}")
    cut = n - config.eval_size
    return everything.select(range(cut)), everything.select(range(cut, n))


def read_documents(path: str, text_field: str, workdir: Path, eval_size: int) -> list[str]:
    """Every document of `path` in order (`xray.data.text`): a built-in task's rows, each its prompt
    followed by its answer (the held-out split first), written under `workdir` with `eval_size`
    held out; else the file or directory's documents (`file_documents`)."""
    if not path.startswith("builtin:"):
        return file_documents(path, text_field)
    task = get_task(path)
    files = task.write(Path(workdir), eval_size)
    rows = [json.loads(line) for f in (files.eval, files.train) for line in f.read_text().splitlines() if line]
    return [f"{r['prompt']}{r[task.answer_field]}" for r in rows]
