"""Prompts for a run: read from a JSONL file, a Parquet file or a Hugging Face `datasets` directory
(`save_to_disk`), tokenised once, with every other column kept. A built-in task (`builtin:arith`)
writes its splits as JSONL files first (`xray.builtin.sources.load_prompt_splits`, a layer above).

The driver samples rows from a `PromptSet`, sends `prompt_ids` to the rollout, and hands the rows'
`prompts` and `extras` to the reward function (TRL's convention: the other columns become keyword
arguments holding one value per sample). `PromptSampler` walks a set in seeded epochs and saves its
position for an exact resume. Bad data stops the run with an error naming the file and line/row.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence


log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


class PromptDataError(ValueError):
    """A prompt source that cannot be used; the message names the file and line or row."""


@dataclass
class PromptSet:
    """Tokenised prompts and the other columns of their rows."""

    prompts: list
    """The prompt field of each row as in the data: a string, or a list of chat messages."""
    prompt_ids: list[list[int]]
    """Token ids of each prompt (chat template applied, truncated per config)."""
    extras: dict[str, list] = field(default_factory=dict)
    """Every other column, one value per row (reaches the reward function as keyword arguments)."""
    where: list[str] = field(default_factory=list)
    """Where each row came from, for error messages: `file.jsonl:12` or `file.parquet row 11`."""
    truncated: int = 0
    """How many prompts were truncated from the left."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices: Sequence[int]) -> "PromptSet":
        """The rows at `indices` (repeats allowed: `[i, i, j, j]` for two samples per prompt)."""
        idx = list(indices)
        return PromptSet([self.prompts[i] for i in idx], [self.prompt_ids[i] for i in idx],
                         {k: [v[i] for i in idx] for k, v in self.extras.items()},
                         [self.where[i] for i in idx] if self.where else [], self.truncated)

    def rows(self, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Row dicts: the other columns, plus `prompt` (the prompt field as in the data) and
        `prompt_ids` (which take precedence over columns of the same names)."""
        idx = range(len(self)) if indices is None else indices
        return [{**{k: v[i] for k, v in self.extras.items()}, "prompt": self.prompts[i],
                 "prompt_ids": self.prompt_ids[i]} for i in idx]


def read_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a JSONL file, Parquet file or `datasets` directory, and where each came from."""
    path = Path(path)
    if not path.exists():
        raise PromptDataError(f"prompt data {path} does not exist; set data.path to a JSONL or Parquet file, "
                              "a `datasets` directory, or builtin:arith")
    if path.is_dir():
        rows, where = _read_datasets_dir(path)
    elif path.suffix in JSONL_SUFFIXES:
        rows, where = _read_jsonl(path)
    elif path.suffix in PARQUET_SUFFIXES:
        rows, where = _read_parquet(path)
    else:
        raise PromptDataError(f"cannot read prompt data {path}: use a {'/'.join(JSONL_SUFFIXES)} or "
                              f"{'/'.join(PARQUET_SUFFIXES)} file, or a directory written by datasets' save_to_disk")
    if not rows:
        raise PromptDataError(f"prompt data {path} is empty: it has no rows")
    return rows, where


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    rows, where = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                      "each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise PromptDataError(f"{path}:{lineno}: a JSON {type(row).__name__}, not an object; "
                                      'each line must be one JSON object such as {"prompt": "..."}')
            rows.append(row)
            where.append(f"{path}:{lineno}")
    return rows, where


def _read_parquet(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise PromptDataError(f"{path}: not a readable Parquet file ({e}); write it with "
                              "pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def _read_datasets_dir(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise PromptDataError(f"{path}: not a directory written by datasets' save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
        if split is None:
            raise PromptDataError(f"{path} holds splits {sorted(ds)} and none is 'train'; save the split "
                                  "to train on alone, or name it 'train'")
        ds = ds[split]
    rows = ds.to_list()
    return rows, [f"{path} row {i}" for i in range(len(rows))]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: Any, chat_template: Optional[bool], where: str) -> list[int]:
    """Token ids of one prompt: a list of chat messages always goes through the tokenizer's chat
    template; a string does when `chat_template` is True, or None (auto) and the tokenizer has one."""
    if isinstance(prompt, list):
        if not has_chat_template(tokenizer):
            raise PromptDataError(f"{where}: the prompt is a list of chat messages but the tokenizer has no "
                                  "chat template; use plain-text prompts or a model whose tokenizer has one")
        messages = prompt
    elif isinstance(prompt, str):
        if chat_template and not has_chat_template(tokenizer):
            raise PromptDataError("a chat template was requested but the tokenizer has none; turn the chat "
                                  "template off or use a model whose tokenizer has one")
        use = has_chat_template(tokenizer) if chat_template is None else chat_template
        if not use:
            return list(tokenizer(prompt).input_ids)
        messages = [{"role": "user", "content": prompt}]
    else:
        raise PromptDataError(f"{where}: the prompt is a {type(prompt).__name__}; it must be a string or "
                              "a list of chat messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def fit_prompt(ids: list[int], max_tokens: int, on_long: str, bos_id: Optional[int], where: str) -> list[int]:
    """`ids` if they fit; else the last tokens (keeping a leading BOS) or an error, per `on_long`."""
    if len(ids) <= max_tokens:
        return ids
    if on_long == "reject":
        raise PromptDataError(f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                              f"{max_tokens}; raise data.max_prompt_tokens, shorten the prompt, or set "
                              "data.on_long_prompt=truncate")
    if on_long != "truncate":
        raise PromptDataError(f"unknown data.on_long_prompt {on_long!r}; use 'truncate' or 'reject'")
    if bos_id is not None and ids[0] == bos_id and max_tokens > 1:
        return [ids[0]] + ids[len(ids) - max_tokens + 1:]
    return ids[len(ids) - max_tokens:]


def load_prompts(path: str | Path, tokenizer, prompt_field: str = "prompt", max_prompt_tokens: int = 32,
                 on_long_prompt: str = "truncate", chat_template: Optional[bool] = None) -> PromptSet:
    """Read, check and tokenise every row of `path`."""
    rows, where = read_rows(path)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    prompts, ids = [], []
    truncated = 0
    for row, loc in zip(rows, where):
        if prompt_field not in row:
            raise PromptDataError(f"{loc}: no {prompt_field!r} field (the row has {sorted(row)}); set "
                                  "data.prompt_field to the column that holds the prompt")
        prompt = row[prompt_field]
        full = encode_prompt(tokenizer, prompt, chat_template, loc)
        if not full:
            raise PromptDataError(f"{loc}: the prompt encodes to no tokens; remove the row or give it text")
        fitted = fit_prompt(full, max_prompt_tokens, on_long_prompt, bos_id, loc)
        truncated += len(fitted) < len(full)
        prompts.append(prompt)
        ids.append(fitted)
    columns = dict.fromkeys(k for row in rows for k in row if k != prompt_field)  # ordered union
    extras = {k: [row.get(k) for row in rows] for k in columns}
    if truncated:
        log.warning("%d of %d prompts in %s were longer than %d tokens and were truncated from the left",
                    truncated, len(rows), path, max_prompt_tokens)
    return PromptSet(prompts, ids, extras, where, truncated)


class PromptSampler:
    """Batches of row indices: each epoch a seeded permutation of the rows, walked in order."""

    def __init__(self, size: int, batch_size: int, seed: int):
        if batch_size < 1 or batch_size > size:
            raise PromptDataError(f"a batch of {batch_size} prompts cannot be drawn from {size} rows; set "
                                  f"ppo.rollout_batch_size between 1 and {size}")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        """The next `batch_size` rows; an epoch's leftover rows are dropped."""
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        out = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size,
                "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = (self.size, self.batch_size, self.seed)
        saved = (state["size"], state["batch_size"], state["seed"])
        if saved != mine:
            raise PromptDataError(f"the checkpoint's prompt sampler had (rows, batch, seed)={saved}, this run "
                                  f"has {mine}; resume with the same data, ppo.rollout_batch_size and seed")
        self.epoch, self.position = state["epoch"], state["position"]
