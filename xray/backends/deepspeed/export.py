"""Full weights out of a ZeRO-sharded module, bucket by bucket, with Hugging Face names.

Sits inside the DeepSpeed training backend; `DeepSpeedEngine.export_weights` calls it, and the
rollout engine's weight sync consumes what it yields. ZeRO stages 1 and 2 keep whole parameters
on every rank (only optimizer state and gradients are sharded), so their buckets are views; on
stage 3 each bucket's parameters are all-gathered with `deepspeed.zero.GatheredParameters`,
copied out on the exporting rank, and re-partitioned before the next bucket is gathered: at most
one bucket of full parameters exists beside the shards at any time.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from xray.backends.base import WeightBucket


def full_numel(param: torch.nn.Parameter) -> int:
    """Elements of the whole parameter, also when ZeRO-3 holds only a shard of it."""
    return int(getattr(param, "ds_numel", param.numel()))


def plan_buckets(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of parameters of at most `bucket_bytes` (a larger one stands alone)."""
    buckets: list[list[tuple[str, torch.nn.Parameter]]] = []
    current: list[tuple[str, torch.nn.Parameter]] = []
    size = 0
    for name, p in named:
        nbytes = full_numel(p) * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def iter_weight_buckets(module: torch.nn.Module, bucket_bytes: int, zero3: bool,
                        exports: bool) -> Iterator[WeightBucket]:
    """Yield (name, full tensor) buckets on the exporting rank; other ranks only join the gathers.

    Every rank must run this generator to the end on stage 3 (each bucket's gather is a collective)."""
    import deepspeed

    for bucket in plan_buckets(list(module.named_parameters()), bucket_bytes):
        params = [p for _, p in bucket]
        gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3
                  else contextlib.nullcontext())
        with gather:
            out = [(name, p.detach().to("cpu", copy=True)) for name, p in bucket] if exports else []
        if exports:
            yield out
