"""The `data` section of a run config: the prompts, their extra columns and the held-out set
(`xray/data/` and `xray/builtin/sources.py` read it). Held by `RunConfig` in `xray.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DataConfig:
    """Prompts and their extra columns."""

    path: str = "builtin:arith"
    """A JSONL or Parquet file, a `datasets` directory, or a built-in task (`builtin:arith`)."""
    prompt_field: str = "prompt"
    """Column holding the prompt."""
    answer_field: str = "answer"
    """Column holding the supervised target (`xray.train sft`; the built-in tasks use `answer`)."""
    max_prompt_tokens: int = 32
    """Longer prompts are handled per `on_long_prompt`."""
    on_long_prompt: Literal["truncate", "reject"] = "truncate"
    """Truncate long prompts from the left, or stop with an error naming the row."""
    eval_size: int = 200
    """Held-out prompts evaluated before and after training."""
