"""Full weights out of a ZeRO-sharded module, bucket by bucket, with Hugging Face names.

Sits inside the DeepSpeed training backend; `DeepSpeedEngine.export_weights` calls it, and the
rollout engine's weight sync consumes what it yields. ZeRO stages 1 and 2 keep whole parameters
on every rank (only optimizer state and gradients are sharded), so their buckets are views; on
stage 3 each bucket's parameters are all-gathered with `deepspeed.zero.GatheredParameters`,
copied out on the exporting rank, and re-partitioned before the next bucket is gathered: at most
one bucket of full parameters exists beside the shards at any time. With LoRA the export yields
each adapted weight merged (W + alpha/r B A), and `adapter_tensors` the adapters alone. Before
the first bucket every rank digests what it holds, and each gathered tensor is judged against
that (`export_check.py`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from xray.backends.base import WeightBucket
from xray.backends.deepspeed.export_check import shard_digests
from xray.backends.deepspeed.lora import hf_units, is_adapter, peft_name
from xray.backends.expert_names import bucketed
from xray.backends.export_digest import ExportCheck, judge
from xray.backends.lora import merge


def full_numel(param: torch.nn.Parameter) -> int:
    """Elements of the whole parameter, also when ZeRO-3 holds only a shard of it."""
    return int(getattr(param, "ds_numel", param.numel()))


Unit = tuple[str, list[torch.nn.Parameter]]
"""One Hugging Face tensor and the parameters that make it (`xray/backends/deepspeed/lora.py`)."""


def plan_buckets(units: list[Unit], bucket_bytes: int) -> list[list[Unit]]:
    """Consecutive groups of tensors of at most `bucket_bytes` (a larger one stands alone), an MoE
    block's tensors kept together (`expert_names.bucketed`)."""
    return bucketed(units, lambda u: u[0], lambda u: full_numel(u[1][0]) * u[1][0].element_size(), bucket_bytes)


def _tensor(params: list[torch.nn.Parameter], scaling: float | None) -> torch.Tensor:
    """A unit's full tensor on the host: the weight, or with an adapter W + scaling B A."""
    if len(params) == 1:
        return params[0].detach().to("cpu", copy=True)
    weight, a, b = (p.detach().cpu() for p in params)
    return merge(weight, a, b, scaling)


def iter_weight_buckets(module: torch.nn.Module, bucket_bytes: int, zero3: bool, exports: bool,
                        scaling: float | None = None, replica: int = 0,
                        verdict: ExportCheck | None = None) -> Iterator[WeightBucket]:
    """Yield (name, full tensor) buckets on the exporting rank; other ranks only join the gathers.
    With LoRA adapters (`scaling` = alpha / r) each adapted weight is yielded merged. With
    `verdict`, every rank first digests what it holds (`export_check.py`: replicas compared on
    stages 1 and 2), and the exporting rank judges the copy of each gathered tensor it yields.

    Every rank must run this generator to the end on stage 3 (each bucket's gather is a collective)."""
    import deepspeed

    units = hf_units(list(module.named_parameters()))
    expected = {}
    if verdict is not None:
        expected = dict(zip((name for name, _ in units), shard_digests(units, zero3, replica, verdict)))
    for bucket in plan_buckets(units, bucket_bytes):
        params = [p for _, unit in bucket for p in unit]
        gather = (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3
                  else contextlib.nullcontext())
        with gather:
            out = [(name, _tensor(unit, scaling)) for name, unit in bucket] if exports else []
        for name, tensor in out if verdict is not None else []:  # the copies about to be yielded
            if expected[name] is None:
                verdict.unchecked.append(name)
            else:
                judge(name, tensor.reshape(-1), expected[name], verdict)
        if exports:
            yield out


def adapter_tensors(module: torch.nn.Module, zero3: bool, exports: bool) -> dict[str, torch.Tensor] | None:
    """The full LoRA tensors with `peft` names on the exporting rank (None elsewhere); every rank
    must call it on stage 3 (one gather of all adapters: they are small)."""
    import deepspeed

    named = [(n, p) for n, p in module.named_parameters() if is_adapter(n)]
    gather = (deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None) if zero3
              else contextlib.nullcontext())
    with gather:
        out = {peft_name(n): p.detach().to("cpu", copy=True) for n, p in named} if exports else None
    return out
