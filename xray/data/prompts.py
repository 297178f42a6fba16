"""Prompts for a run: rows read by `xray.data.files` (JSON, JSONL, Parquet or CSV files, compressed
or not, lists and globs of them, hub-layout and `datasets` directories), tokenised once, with every
other column kept. A built-in task (`builtin:arith`) writes its splits as JSONL files first, and
the train and eval sources are chosen one layer above (`xray.builtin.sources.load_prompt_splits`).

The driver samples rows from a `PromptSet`, sends `prompt_ids` to the rollout, and hands the rows'
`prompts` and `extras` to the reward function (TRL's convention: the other columns become keyword
arguments holding one value per sample). `PromptSampler` walks a set in seeded epochs and saves its
position for an exact resume. Bad data stops the run with an error naming the file and line/row.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from xray.data.chat import ChatFormat, ChatTemplateError, PromptRenderer
from xray.data.files import Source, read_rows


log = logging.getLogger(__name__)

LONG_PROMPT_RULES = ("filter", "truncate", "reject")
"""What `data.on_long_prompt` may say: leave a longer prompt out, keep its last tokens, or stop."""


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
    """How many prompts were truncated from the left (`on_long_prompt=truncate`)."""
    dropped: int = 0
    """How many rows were left out for a prompt longer than the limit (`on_long_prompt=filter`)."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices: Sequence[int]) -> "PromptSet":
        """The rows at `indices` (repeats allowed: `[i, i, j, j]` for two samples per prompt)."""
        idx = list(indices)
        return PromptSet([self.prompts[i] for i in idx], [self.prompt_ids[i] for i in idx],
                         {k: [v[i] for i in idx] for k, v in self.extras.items()},
                         [self.where[i] for i in idx] if self.where else [], self.truncated, self.dropped)

    def rows(self, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Row dicts: the other columns, plus `prompt` (the prompt field as in the data) and
        `prompt_ids` (which take precedence over columns of the same names)."""
        idx = range(len(self)) if indices is None else indices
        return [{**{k: v[i] for k, v in self.extras.items()}, "prompt": self.prompts[i],
                 "prompt_ids": self.prompt_ids[i]} for i in idx]


def encode_prompt(renderer: PromptRenderer, prompt: Any, where: str) -> list[int]:
    """Token ids of one prompt under the run's chat settings (`xray.data.chat`); errors name the row."""
    try:
        ids = renderer.ids(prompt)
    except ChatTemplateError as exc:
        raise PromptDataError(f"{where}: {exc}") from None
    if not ids:
        raise PromptDataError(f"{where}: the prompt encodes to no tokens; remove the row or give it text")
    return ids


def fit_prompt(ids: list[int], max_tokens: int, on_long: str, bos_id: Optional[int], where: str) -> Optional[list[int]]:
    """`ids` if they fit; else, per `on_long`, None (`filter`: the row is left out), the last tokens
    keeping a leading BOS (`truncate`), or an error (`reject`)."""
    if on_long not in LONG_PROMPT_RULES:
        raise PromptDataError(f"unknown data.on_long_prompt {on_long!r}; use one of {', '.join(LONG_PROMPT_RULES)}")
    if len(ids) <= max_tokens:
        return ids
    if on_long == "filter":
        return None
    if on_long == "reject":
        raise PromptDataError(f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                              f"{max_tokens}; raise data.max_prompt_tokens, shorten the prompt, or set "
                              "data.on_long_prompt to filter (leave such rows out) or truncate")
    if bos_id is not None and ids[0] == bos_id and max_tokens > 1:
        return [ids[0]] + ids[len(ids) - max_tokens + 1:]
    return ids[len(ids) - max_tokens:]


def load_prompts(path: Source, tokenizer, prompt_field: str = "prompt", max_prompt_tokens: int = 32,
                 on_long_prompt: str = "filter", chat: ChatFormat = ChatFormat()) -> PromptSet:
    """Read, check and tokenise every row of `path` (any source `xray.data.files.read_rows` takes,
    rows already read included) under the chat settings `chat`; rows whose prompt is longer than
    `max_prompt_tokens` are left out, truncated or refused per `on_long_prompt`."""
    rows, where = read_rows(path)
    try:
        renderer = PromptRenderer(tokenizer, chat)
    except ChatTemplateError as exc:
        raise PromptDataError(str(exc)) from None
    bos_id = getattr(tokenizer, "bos_token_id", None)
    kept, ids = [], []
    truncated = 0
    for i, (row, loc) in enumerate(zip(rows, where)):
        if prompt_field not in row:
            raise PromptDataError(f"{loc}: no {prompt_field!r} field (the row has {sorted(row)}); set "
                                  "data.prompt_field to the column that holds the prompt")
        full = encode_prompt(renderer, row[prompt_field], loc)
        fitted = fit_prompt(full, max_prompt_tokens, on_long_prompt, bos_id, loc)
        if fitted is None:
            continue
        truncated += len(fitted) < len(full)
        kept.append(i)
        ids.append(fitted)
    dropped = len(rows) - len(kept)
    if dropped:
        log.warning("%d of %d prompts in %s are longer than data.max_prompt_tokens=%d and were left out "
                    "(data.on_long_prompt=filter); raise data.max_prompt_tokens to keep them",
                    dropped, len(rows), path, max_prompt_tokens)
    if not kept:
        raise PromptDataError(f"every prompt in {path} is longer than data.max_prompt_tokens={max_prompt_tokens} "
                              "tokens; raise data.max_prompt_tokens or set data.on_long_prompt=truncate")
    if truncated:
        log.warning("%d of %d prompts in %s were longer than data.max_prompt_tokens=%d and were truncated from "
                    "the left (data.on_long_prompt=truncate)", truncated, len(rows), path, max_prompt_tokens)
    kept_rows = [rows[i] for i in kept]
    columns = dict.fromkeys(k for row in kept_rows for k in row if k != prompt_field)  # ordered union
    extras = {k: [row.get(k) for row in kept_rows] for k in columns}
    return PromptSet([row[prompt_field] for row in kept_rows], ids, extras, [where[i] for i in kept], truncated,
                     dropped)


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
