"""The fan-out protocol: how one call on a WholeModel becomes calls on its shards, and back.

A Workhorse method is marked with `@fanout(dispatch=..., execute=..., collect=...)`; the
decorator only attaches metadata, so the Workhorse stays a plain class. The functions below are
pure (no Ray) and unit-tested:

- dispatch `all`: every shard gets the same arguments. `slice`: batch-like arguments (Batch,
  tensor, list, tuple) are split into `dp_size` equal parts in order; the shards of one
  data-parallel replica (its TP/PP peers) get the same part. A callable
  `(layout, args, kwargs) -> [(args, kwargs) per shard]` decides freely.
- execute `all`, or `first` (rank 0 alone; never for a method that enters a collective).
- collect `none`: the results of the collector shard of each replica (tp_rank 0 on the last
  pipeline stage), in dp order. `flatten`: those results concatenated (sequence columns of
  Batches right-padded to the widest part). A callable `(layout, results_of_every_shard) ->
  answer` decides freely.
- reads: the Batch columns the method reads (a tuple, or a callable of the call's `(args,
  kwargs)`); only those are shipped. None ships every column.

An argument may also be the answer of another `flatten` call still in the object store, as its
parts (object refs of equal-sized parts in order): `remote_slices` says which parts and rows each
replica takes, as a `PartsSlice` that the receiving Workhorse fetches and `assemble`s itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from xray.backends.base import ShardInfo
from xray.data.batch import Batch, BatchError

Dispatch = Union[str, Callable]
Collect = Union[str, Callable]
Reads = Union[None, tuple, Callable]
ATTR = "_xray_fanout"


class DispatchError(ValueError):
    """Arguments that cannot be dispatched as asked; the message says how to fix them."""


@dataclass(frozen=True)
class FanOut:
    """The metadata `@fanout` attaches to a Workhorse method."""

    dispatch: Dispatch = "all"
    execute: str = "all"
    collect: Collect = "none"
    deadline_s: float = 600.0
    """Default deadline of a call; a call may pass its own."""
    reads: Reads = None
    """Batch columns the method reads; only those are shipped (None: all)."""

    def columns(self, args: tuple, kwargs: dict) -> tuple[str, ...] | None:
        """The columns to ship for this call's Batch arguments (None: all)."""
        if callable(self.reads):
            found = self.reads(args, kwargs)
            return None if found is None else tuple(found)
        return self.reads


def fanout(dispatch: Dispatch = "all", execute: str = "all", collect: Collect = "none",
           deadline_s: float = 600.0, reads: Reads = None) -> Callable:
    """Mark a Workhorse method as callable through its WholeModel."""
    if isinstance(dispatch, str) and dispatch not in ("all", "slice"):
        raise ValueError(f"dispatch must be 'all', 'slice' or a callable, got {dispatch!r}")
    if execute not in ("all", "first"):
        raise ValueError(f"execute must be 'all' or 'first', got {execute!r}")
    if isinstance(collect, str) and collect not in ("none", "flatten"):
        raise ValueError(f"collect must be 'none', 'flatten' or a callable, got {collect!r}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, ATTR, FanOut(dispatch, execute, collect, deadline_s, reads))
        return fn

    return mark


def fanout_methods(cls: type) -> dict[str, FanOut]:
    """The marked methods of a Workhorse class, by name."""
    out = {}
    for name in dir(cls):
        meta = getattr(getattr(cls, name, None), ATTR, None)
        if isinstance(meta, FanOut):
            out[name] = meta
    return out


def is_sliceable(x: Any) -> bool:
    return isinstance(x, (Batch, torch.Tensor, list, tuple))


def split_one(x: Any, parts: int, where: str) -> list:
    n = len(x)
    if n % parts:
        raise DispatchError(
            f"{where} has {n} rows, which do not split evenly over {parts} data-parallel replicas; "
            f"pass a multiple of {parts} rows (or change dp); nothing is padded silently")
    if isinstance(x, Batch):
        try:
            return x.split(parts)
        except BatchError as exc:
            raise DispatchError(f"{where}: {exc}") from None
    step = n // parts
    return [x[i * step:(i + 1) * step] for i in range(parts)]


def slice_parts(dp_size: int, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """Split every batch-like argument into `dp_size` parts: one (args, kwargs) per replica."""
    split_args = [(split_one(a, dp_size, f"argument {i}") if is_sliceable(a) else None)
                  for i, a in enumerate(args)]
    split_kwargs = {k: (split_one(v, dp_size, f"argument {k!r}") if is_sliceable(v) else None)
                    for k, v in kwargs.items()}
    parts = []
    for d in range(dp_size):
        a = tuple(s[d] if s is not None else args[i] for i, s in enumerate(split_args))
        kw = {k: (s[d] if s is not None else kwargs[k]) for k, s in split_kwargs.items()}
        parts.append((a, kw))
    return parts


def dispatch(layout: Sequence[ShardInfo], mode: Dispatch, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    """Arguments per shard, in rank order (`layout[i]` is rank i)."""
    if callable(mode):
        per_shard = list(mode(layout, args, kwargs))
        if len(per_shard) != len(layout):
            raise DispatchError(f"a dispatch callable returned {len(per_shard)} argument sets for "
                                f"{len(layout)} shards; return one (args, kwargs) per shard")
        return per_shard
    if mode == "all":
        return [(args, kwargs)] * len(layout)
    parts = slice_parts(layout[0].dp_size, args, kwargs)
    return [parts[s.dp_rank] for s in layout]


def part_of_shard(layout: Sequence[ShardInfo]) -> list[int]:
    """For `slice`: which replica's part each shard gets (its dp_rank)."""
    return [s.dp_rank for s in layout]


def collectors(layout: Sequence[ShardInfo]) -> list[int]:
    """Rank of the collecting shard of each replica, in dp order."""
    by_dp = {s.dp_rank: s.rank for s in layout if s.collects}
    missing = sorted(set(range(layout[0].dp_size)) - set(by_dp))
    if missing:
        raise DispatchError(f"no shard reports collecting for data-parallel replicas {missing}")
    return [by_dp[d] for d in range(layout[0].dp_size)]


def concat(results: list) -> Any:
    """Join per-replica results: Batch, tensor (dim 0), list/tuple, or dicts of those."""
    first = results[0]
    if isinstance(first, Batch):
        return Batch.concat(results, pad_width=True)
    if isinstance(first, torch.Tensor):
        return torch.cat(results)
    if isinstance(first, (list, tuple)):
        return [x for r in results for x in r]
    if isinstance(first, dict):
        return {k: concat([r[k] for r in results]) for k in first}
    raise DispatchError(f"collect='flatten' cannot join results of type {type(first).__name__}; "
                        "return a Batch, tensor, list or dict of those, or use a collect callable")


def collect(layout: Sequence[ShardInfo], mode: Collect, results: list) -> Any:
    """The answer of a call from the results of every shard (`results[i]` from rank i)."""
    if callable(mode):
        return mode(layout, results)
    picked = [results[r] for r in collectors(layout)]
    if mode == "none":
        return picked
    return concat(picked)


def select_columns(value: Any, columns: tuple[str, ...] | None) -> Any:
    """`value` with only `columns` if it is a Batch that has them all (else unchanged)."""
    if columns is None or not isinstance(value, Batch):
        return value
    missing = [c for c in columns if c not in value]
    if missing:
        raise DispatchError(f"the method reads columns {missing}, which the batch lacks (it has "
                            f"{value.keys()}); add them to the batch")
    return value.select(columns)


@dataclass(frozen=True)
class PartsSlice:
    """One replica's rows of an answer that stays in the object store as equal-sized parts.

    `parts` are the refs of the parts its rows lie in; of their concatenation it takes
    `part_rows * take / den` rows after skipping `part_rows * skip / den`."""

    parts: tuple
    skip: int
    take: int
    den: int
    columns: tuple[str, ...] | None = None


def remote_slices(num_parts: int, replicas: int) -> list[tuple[int, int, int, int, int]]:
    """For each of `replicas`: (first part, end part, skip, take, den) over `num_parts` equal parts."""
    out = []
    for d in range(replicas):
        lo, hi = d * num_parts, (d + 1) * num_parts  # in units of 1/replicas parts
        first, end = lo // replicas, -(-hi // replicas)
        out.append((first, end, lo - first * replicas, num_parts, replicas))
    return out


def assemble(values: list, piece: PartsSlice) -> Any:
    """The rows `piece` names, from the fetched values of its parts."""
    sizes = {len(v) for v in values}
    if len(sizes) != 1:
        raise DispatchError(f"parts passed by reference have different sizes {sorted(sizes)}; only equal "
                            "parts can be re-split (fetch the answer and pass it by value)")
    rows = sizes.pop()
    skip, take = rows * piece.skip, rows * piece.take
    if skip % piece.den or take % piece.den:
        raise DispatchError(f"{rows * len(values)} rows passed by reference do not split evenly over "
                            f"{piece.den} data-parallel replicas; pass a multiple of {piece.den} rows")
    joined = values[0] if len(values) == 1 else concat(values)
    skip, take = skip // piece.den, take // piece.den
    if skip or take != len(joined):
        joined = joined.index(slice(skip, skip + take)) if isinstance(joined, Batch) else joined[skip:skip + take]
    return select_columns(joined, piece.columns)
