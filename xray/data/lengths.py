"""Length-grouped micro-batches for a train step: the rows of one replica's slice ordered by
length, cut into micro-batches of rows of similar length, each cut down to its longest row.

Why: a rollout pads every row to the longest response of the whole batch. On a CPU (or any device
where compute grows with tokens) a micro-batch of short rows then pays for the longest; grouped
and trimmed, it pays for its own rows only.

Why it is exact: rows are left-aligned (padding at the right end, `xray.data.columns`), so cutting
off columns past a micro-batch's longest row changes no output of a causal model at a real
position. Grouping does change which rows share a micro-batch, and a loss averaged inside its
micro-batch would then weigh rows differently. So every micro-batch carries the slice's totals in
its meta under `NORM` (a `LossNorm`): the loss tokens and the rows with a loss token, each divided
by the number of micro-batches. A loss that divides its micro-batch's sums by these, accumulated
as every engine accumulates (the mean over micro-batches), is the mean over the whole slice:
the same number however the rows are grouped. A mini-batch sent to data-parallel replicas carries
its own totals (`with_totals`, the trainer's): each slice then divides by those, and the replicas'
averaged gradient is the whole mini-batch's mean, whichever replica trains which row (so the
trainer may assign rows to replicas by cost, `xray/data/balance.py`).

A loss function opts in with a true `by_length` attribute (`xray.backends.base.LossFn`); engines
call `train_micro_batches`, which falls back to consecutive chunks for any other loss (a reward
model's (chosen, rejected) pairs must stay together, for one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from xray.data import columns as C
from xray.data.batch import Batch, BatchError
from xray.data.budget import budget_groups, trimmed

NORM = "loss_norm"
"""Meta key of a grouped micro-batch: its `LossNorm`."""
TOTALS = "loss_totals"
"""Meta key of a mini-batch sent to data-parallel replicas (`with_totals`): the whole mini-batch's
(loss tokens, rows with a loss token), so that each replica's slice divides by those rather than
its own: the loss is the mean over the whole mini-batch whichever replica trains which row."""


@dataclass(frozen=True)
class LossNorm:
    """The slice-wide denominators one micro-batch's loss divides by (each total / micro-batches)."""

    tokens: float
    """Loss-mask tokens of the whole slice / micro-batches (1.0 when the slice has none)."""
    rows: float
    """Rows of the slice with at least one loss token / micro-batches (1.0 when none)."""


def with_totals(batch: Batch) -> Batch:
    """`batch` (a whole mini-batch) with its loss totals in meta (`TOTALS`); the same columns."""
    mask = batch[C.LOSS_MASK]
    out = Batch(dict(batch.tensors), dict(batch.lists), dict(batch.meta))
    out.meta[TOTALS] = (float(mask.sum()), float((mask.sum(1) > 0).sum()))
    return out


def grouped_micro_batches(batch: Batch, size: int, trim: bool = True, replicas: int = 1) -> list[Batch]:
    """`batch` in micro-batches of `size` rows, longest rows first, each with its `LossNorm` in
    meta and (with `trim`) its columns cut to its longest row. Needs ATTENTION_MASK and LOSS_MASK.
    `trim=False` keeps one width for all (a pipeline schedule sends one activation shape).

    The denominators are the slice's own totals; or, when the batch carries its mini-batch's
    (`TOTALS`, it is one of `replicas` data-parallel slices whose gradients are averaged), those
    divided by `replicas` as well: the averaged gradient is then the whole mini-batch's mean."""
    n = len(batch)
    if size < 1 or n % size:
        raise BatchError(f"micro-batch size {size} does not divide the batch of {n} rows; "
                         "choose a micro-batch size that divides the batch size")
    _require_columns(batch)
    parts = n // size
    lengths = batch[C.ATTENTION_MASK].sum(1)
    order = torch.argsort(lengths, descending=True, stable=True)
    return micro_batches_of(batch, [order[i * size:(i + 1) * size] for i in range(parts)], trim, replicas)


def _require_columns(batch: Batch) -> None:
    for key in (C.ATTENTION_MASK, C.LOSS_MASK):
        if key not in batch.tensors:
            raise BatchError(f"length grouping needs the {key!r} column; ship it with the train step "
                             "(list it in the loss function's `reads`)")


def micro_batches_of(batch: Batch, groups: list[torch.Tensor], trim: bool = True, replicas: int = 1) -> list[Batch]:
    """The micro-batches of `batch` holding the rows `groups` names, each with its `LossNorm`
    (the slice's totals, or its mini-batch's over `replicas`, divided by the micro-batches) and
    with `trim` cut to its longest row."""
    lengths = batch[C.ATTENTION_MASK].sum(1)
    mask = batch[C.LOSS_MASK]
    parts = len(groups)
    if TOTALS in batch.meta:
        tokens, rows = batch.meta[TOTALS]
        parts_total = parts * replicas
    else:
        tokens, rows, parts_total = float(mask.sum()), float((mask.sum(1) > 0).sum()), parts
    norm = LossNorm(tokens / parts_total if tokens else 1.0, rows / parts_total if rows else 1.0)
    micro = []
    for idx in groups:
        mb = batch.index(idx)
        if trim:
            mb = trimmed(mb, max(int(lengths[idx].max()), 2))  # at least one predicted position
        mb.meta[NORM] = norm
        micro.append(mb)
    return micro


def train_micro_batches(batch: Batch, loss_fn: Any, size: int, trim: bool = True, replicas: int = 1,
                        max_tokens: int | None = None, agree: Callable[[int], int] | None = None,
                        packed: bool = False) -> list[Batch]:
    """A train step's micro-batches: length-grouped when `loss_fn.by_length` is true, else
    consecutive chunks of `size` rows. `replicas`: the data-parallel replicas averaging the
    gradients (`grouped_micro_batches`). With `max_tokens`, a length-grouped step cuts by that
    token budget instead of by `size` rows (`xray.data.budget`); `agree` maps this rank's
    micro-batch count to the count every rank takes (a backend whose every forward and backward
    is collective, ZeRO-3's, needs one); `packed`: the budget counts a micro-batch's tokens
    without padding, as the engine will pack it (`xray.data.packing`)."""
    if getattr(loss_fn, "by_length", False):
        if max_tokens is not None:
            _require_columns(batch)
            lengths = batch[C.ATTENTION_MASK].sum(1)
            groups = budget_groups(lengths, max_tokens, packed=packed)
            if agree is not None:
                groups = budget_groups(lengths, max_tokens, agree(len(groups)), packed)
            return micro_batches_of(batch, groups, trim, replicas)
        return grouped_micro_batches(batch, size, trim, replicas)
    return batch.chunks(size)


def loss_norm(batch: Batch | Mapping) -> LossNorm | None:
    """The micro-batch's `LossNorm`, or None when it was not length-grouped (or is a plain
    mapping of columns, as in a hand-built test)."""
    return getattr(batch, "meta", {}).get(NORM)
