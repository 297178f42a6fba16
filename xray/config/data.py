"""The `data` section of a run config: the prompts, their extra columns and the held-out set
(`xray/data/` and `xray/builtin/sources.py` read it). Held by `RunConfig` in `xray.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


@dataclass(frozen=True)
class DataConfig:
    """Prompts and their extra columns."""

    path: Union[str, list[str]] = "builtin:arith"
    """The training data (`xray.data.files`): a JSON (array, object or lines), JSONL, Parquet or CSV
    file, each possibly `.gz`, `.bz2`, `.xz` or `.zst`; a list or glob of them (`data/*.parquet`); a
    directory of split files as on the Hugging Face hub (`data/train-00000-of-00001.parquet`,
    `train.jsonl` + `test.jsonl`); a `datasets` save_to_disk directory; or a built-in task
    (`builtin:arith`), which writes its own train and eval splits."""
    split: str = "train"
    """The split of `path` trained on, where `path` is a directory holding several (a file, list or
    glob is the one split `train`)."""
    prompt_field: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages `{role, content}` (veRL's
    parquet `prompt` column, TRL's conversational `prompt`, OpenRLHF's `input_key`)."""
    chat_template: str = "auto"
    """How prompts become text: `auto` (the tokenizer's chat template when it has one, else the
    plain string), `none` (the plain string always: a base model that ships a template, trained
    on raw prompts; message lists are refused), or the path of a Jinja chat template file."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables the chat template is rendered with (`apply_chat_template`'s keyword arguments,
    e.g. `{enable_thinking: false}`); needs a template."""
    system_prompt: Optional[str] = None
    """Put first as a system message in every prompt that has none (it replaces a template's
    default system line); needs a template. Null: nothing added."""
    answer_field: str = "answer"
    """Column holding the supervised target (`xray.train sft`; the built-in tasks use `answer`)."""
    max_prompt_tokens: int = 32
    """Longest prompt in tokens, chat template included; longer ones are handled per
    `on_long_prompt`. The rollout engine's context is sized for it plus the response
    (it must fit the model's `max_position_embeddings`), so raise it for real prompts."""
    on_long_prompt: Literal["filter", "truncate", "reject"] = "filter"
    """`filter`: leave longer prompts out (their count is logged at the start); `truncate`: keep
    their last tokens (a leading BOS kept; the count is logged); `reject`: stop with an error
    naming the row."""
    eval_size: int = 200
    """Held-out prompts evaluated before and after training. With `eval_path` or `eval_split`: a
    seeded sample of that many of its rows (all when it has exactly that many; fewer is an error).
    Without: a seeded random sample of that many rows of `path`, left out of training (a built-in
    task holds out its own)."""
    eval_path: Union[str, list[str]] = ""
    """A separate eval set, in any form `path` takes (not a built-in task); empty: none. Its split is
    `eval_split` where it holds several."""
    eval_split: str = ""
    """A split of `path` (or of `eval_path` when set) to evaluate on, e.g. `test`; empty: none (the
    only split of `eval_path`, or rows held out of `path`)."""
    eval_seed: int = 0
    """Seed of the sample of `eval_size` eval rows, apart from the run's `seed` so that runs with
    different seeds evaluate on the same rows."""
    messages_field: str = "messages"
    """Column holding a conversation (a list of `{role, content}` messages) for `xray.train sft`: a
    row with it trains on its assistant turns only, rendered by the chat template. A row whose
    `prompt_field` and `answer_field` both hold messages (TRL's conversational prompt/completion,
    `data.answer_field=completion`) trains on the completion's assistant turns."""
