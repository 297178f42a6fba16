"""Token-budget micro-batches: a replica's rows cut into micro-batches by the tokens they cost,
not by a fixed row count (`<role>.max_tokens_per_micro_batch`, the engines' forwards and train
steps; veRL's dynamic batch size, OpenRLHF's `max_tokens_per_gpu`).

A micro-batch's cost is its rows times its longest row (what a padded forward computes); rows go
longest first, so a micro-batch of long rows holds few and one of short rows holds many, each cut
down to its own longest row (`trimmed`, which the length-grouped micro-batches of
`xray.data.lengths` use too). A row longer than the budget goes alone: it cannot be split.

Where every forward and backward is collective across data-parallel ranks (ZeRO-3 gathers each
layer's parameters), every rank must run the same number of micro-batches: the engine agrees on
the largest count and the others split their costliest micro-batches until they have as many
(`budget_groups(..., count=)`).

Train steps stay exact: each micro-batch carries its slice's loss denominators
(`xray.data.lengths.micro_batches_of`), so the step is the same however the rows were grouped.
Forwards are restored to the batch's row order and width (`restored`): the positions past a row's
length hold zeros instead of the padded forward's values, which no consumer reads (they are
masked by ATTENTION_MASK and LOSS_MASK).
"""
from __future__ import annotations

from typing import Callable

import torch

from xray.data import columns as C
from xray.data.batch import Batch, BatchError


def budget_groups(lengths: torch.Tensor, max_tokens: int, count: int | None = None,
                  packed: bool = False) -> list[torch.Tensor]:
    """Row indices of micro-batches costing at most `max_tokens` each (rows x the longest row; with
    `packed`, the sum of the rows, filled first-fit), longest rows first; with `count` (at least
    the budget's own count, at most the rows), the costliest micro-batches split in halves until
    there are exactly `count`."""
    if max_tokens < 1:
        raise BatchError(f"max_tokens_per_micro_batch={max_tokens}; give a positive token budget "
                         "(at least the longest sequence), or null to cut by micro_batch_size rows")
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    sizes = [max(int(n), 2) for n in lengths.tolist()]
    groups = _first_fit(order, sizes, max_tokens) if packed else _next_fit(order, sizes, max_tokens)
    if count is not None:
        if not len(groups) <= count <= len(order):
            raise BatchError(f"cannot cut {len(order)} rows into {count} micro-batches under the budget "
                             f"(it needs {len(groups)}); every data-parallel rank must hold as many rows")
        while len(groups) < count:
            costs = [(sum(sizes[i] for i in g) if packed else len(g) * sizes[g[0]]) if len(g) > 1 else -1
                     for g in groups]
            j = max(range(len(groups)), key=costs.__getitem__)
            g = groups.pop(j)
            groups[j:j] = [g[:len(g) // 2], g[len(g) // 2:]]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def _next_fit(order: list[int], sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Padded micro-batches: the rows in `order` (longest first) while rows x the first fits."""
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * sizes[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _first_fit(order: list[int], sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Packed micro-batches: each row (longest first) into the first whose sum it fits."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        j = next((j for j, t in enumerate(totals) if t + sizes[i] <= max_tokens), len(groups))
        if j == len(groups):
            groups.append([])
            totals.append(0)
        groups[j].append(i)
        totals[j] += sizes[i]
    return groups


def trimmed(batch: Batch, length: int) -> Batch:
    """The batch with its `[B, T]` columns cut to `length` and its `[B, T-1]` columns to
    `length - 1` (other columns as they are)."""
    width = batch[C.ATTENTION_MASK].shape[1]
    if length >= width:
        return batch
    keep = {width: length, width - 1: max(length - 1, 0)}
    tensors = {k: (v[:, :keep[v.shape[1]]].contiguous() if v.dim() >= 2 and v.shape[1] in keep else v)
               for k, v in batch.tensors.items()}
    return Batch(tensors, dict(batch.lists), dict(batch.meta))


def forward_micro_batches(batch: Batch, max_tokens: int, agree: Callable[[int], int] | None = None,
                          packed: bool = False) -> tuple[list[Batch], torch.Tensor]:
    """`batch` in token-budget micro-batches, each cut to its longest row, and the row order they
    hold (for `restored`). `agree`: as in `xray.data.lengths.train_micro_batches`; `packed`: the
    micro-batches will be packed (`budget_groups`)."""
    lengths = batch[C.ATTENTION_MASK].sum(1)
    groups = budget_groups(lengths, max_tokens, packed=packed)
    if agree is not None:
        groups = budget_groups(lengths, max_tokens, agree(len(groups)), packed)
    micro = [trimmed(batch.index(g), max(int(lengths[g].max()), 2)) for g in groups]
    return micro, torch.cat(groups)


def restored(outputs: list[dict[str, torch.Tensor]], order: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
    """The micro-batches' outputs (`[b, w]` each, w <= width) as one `[rows, width]` per key, in
    the batch's row order; zeros past each micro-batch's width."""
    out = {}
    for key in outputs[0]:
        parts = [o[key] for o in outputs]
        padded = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
        joined = torch.cat(padded)
        whole = torch.empty_like(joined)
        whole[order.to(joined.device)] = joined
        out[key] = whole
    return out

