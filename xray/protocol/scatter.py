"""Dispatch: the arguments each shard of a WholeModel receives for one call (`all`, `slice` or a
callable; see `xray/protocol/__init__.py`), and the Batch columns a method reads. Pure functions,
no Ray; the WholeModel (`xray/wholemodel`) calls them."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from xray.backends.base import ShardInfo
from xray.data.batch import Batch, BatchError
from xray.protocol.mark import Dispatch, DispatchError


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


def select_columns(value: Any, columns: tuple[str, ...] | None) -> Any:
    """`value` with only `columns` if it is a Batch that has them all (else unchanged)."""
    if columns is None or not isinstance(value, Batch):
        return value
    missing = [c for c in columns if c not in value]
    if missing:
        raise DispatchError(f"the method reads columns {missing}, which the batch lacks (it has "
                            f"{value.keys()}); add them to the batch")
    return value.select(columns)
