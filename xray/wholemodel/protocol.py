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
  pipeline stage), in dp order. `flatten`: those results concatenated. A callable
  `(layout, results_of_every_shard) -> answer` decides freely.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch

from xray.backends.base import ShardInfo
from xray.data.batch import Batch, BatchError

Dispatch = Union[str, Callable]
Collect = Union[str, Callable]
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


def fanout(dispatch: Dispatch = "all", execute: str = "all", collect: Collect = "none",
           deadline_s: float = 600.0) -> Callable:
    """Mark a Workhorse method as callable through its WholeModel."""
    if isinstance(dispatch, str) and dispatch not in ("all", "slice"):
        raise ValueError(f"dispatch must be 'all', 'slice' or a callable, got {dispatch!r}")
    if execute not in ("all", "first"):
        raise ValueError(f"execute must be 'all' or 'first', got {execute!r}")
    if isinstance(collect, str) and collect not in ("none", "flatten"):
        raise ValueError(f"collect must be 'none', 'flatten' or a callable, got {collect!r}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, ATTR, FanOut(dispatch, execute, collect, deadline_s))
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


def _is_sliceable(x: Any) -> bool:
    return isinstance(x, (Batch, torch.Tensor, list, tuple))


def _split_one(x: Any, parts: int, where: str) -> list:
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
    split_args = [(_split_one(a, dp_size, f"argument {i}") if _is_sliceable(a) else None)
                  for i, a in enumerate(args)]
    split_kwargs = {k: (_split_one(v, dp_size, f"argument {k!r}") if _is_sliceable(v) else None)
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
        return Batch.concat(results)
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
