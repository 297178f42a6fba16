"""Collect: one call's answer from the results of every shard of a WholeModel (`none`, `flatten`
or a callable; see `xray/protocol/__init__.py`): the collecting shard of each replica (tp_rank 0
on the last pipeline stage), their results joined. Pure functions, no Ray."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from xray.backends.base import ShardInfo
from xray.data.batch import Batch
from xray.protocol.mark import Collect, DispatchError


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
