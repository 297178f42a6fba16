"""Streaming the full weights, with Hugging Face names, from one replica's shards to its first.

Used by `MegatronEngine.export_weights` (weight sync to the rollout engine, HF checkpoints). Every
rank computes the same plan from the model spec alone: the exported entries of every pipeline
stage in order, cut into buckets of bounded size. For each bucket, each shard of the exporting
data-parallel replica (the first, unless asked) that holds part of it packs its pieces into one
flat buffer and sends it to that replica's first rank (point-to-point, so ranks that hold nothing
of a bucket stay idle), which unpacks the buffers, rebuilds the HF tensors with
`convert.from_shards` and yields them. With LoRA the adapted weights are exported merged (the
engine passes their merged shards), and `gather_entries` brings the adapter tensors themselves
(`lora.py`'s entries, `peft` names) to the same rank in one piece.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from xray.backends.megatron.convert import Entry, Kind, from_shards, shard_shape, stage_entries
from xray.backends.megatron.spec import ModelSpec
from xray.config.parallel import ParallelDims


@dataclass(frozen=True)
class Planned:
    """One exported entry and the pipeline stage that holds it."""

    stage: int
    entry: Entry


def plan_buckets(spec: ModelSpec, parallel: ParallelDims, critic: bool, bucket_bytes: int,
                 element_size: int = 4) -> list[list[Planned]]:
    """The exported entries of all stages, in order, grouped so a bucket's full HF tensors stay
    under `bucket_bytes` (an entry larger than that is its own bucket)."""
    buckets: list[list[Planned]] = [[]]
    size = 0
    for stage in range(parallel.pp):
        for entry in stage_entries(spec, stage, parallel.pp, critic):
            if not entry.exported:
                continue
            copies = 1 if entry.kind is Kind.REPLICATED else parallel.tp
            nbytes = _numel(entry, spec, parallel.tp) * copies * element_size
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(Planned(stage, entry))
            size += nbytes
    return [b for b in buckets if b]


def _numel(entry: Entry, spec: ModelSpec, tp: int) -> int:
    return math.prod(shard_shape(entry, spec, tp))


def _send_bucket(bucket: list[Planned], params: Mapping[str, torch.Tensor], stage: int, dst: int) -> None:
    mine = [params[p.entry.megatron_name].detach().reshape(-1) for p in bucket if p.stage == stage]
    if mine:
        dist.send(torch.cat(mine), dst=dst)


def _receive_bucket(bucket: list[Planned], params: Mapping[str, torch.Tensor], shape: Callable[[Entry], tuple],
                    parallel: ParallelDims, replica: int) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The exporting rank: the shards of every entry of the bucket, keyed by (stage, index in
    bucket); `shape` gives the shape of one shard of an entry."""
    shards: dict[tuple[int, int], list[torch.Tensor]] = {}
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    for stage in sorted({p.stage for p in bucket}):
        indexed = [(i, p.entry) for i, p in enumerate(bucket) if p.stage == stage]
        for tp_rank in range(parallel.tp):
            src = parallel.rank_of(tp_rank, stage, replica)
            if src == dist.get_rank():
                pieces = [params[e.megatron_name].detach().clone() for _, e in indexed]
            else:
                sizes = [math.prod(shape(e)) for _, e in indexed]
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                dist.recv(flat, src=src)
                pieces = [t.view(shape(e)) for t, (_, e) in zip(flat.split(sizes), indexed)]
            for (i, _), piece in zip(indexed, pieces):
                shards.setdefault((stage, i), []).append(piece)
    return shards


def export_full(model: torch.nn.Module, spec: ModelSpec, parallel: ParallelDims, critic: bool,
                bucket_bytes: int, replica: int = 0,
                tensors: Mapping[str, torch.Tensor] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective over all ranks: the first shard of data-parallel replica `replica` (global rank
    0 for replica 0) yields buckets of (HF name, full CPU tensor); that replica's other shards
    send it their pieces, and every other rank yields nothing. `tensors` (Megatron name -> this
    rank's shard; default: the model's parameters) is what is read (LoRA: merged weights)."""
    rank = dist.get_rank()
    coords = parallel.coords(rank)
    exporter = parallel.rank_of(0, 0, replica)
    params = dict(model.named_parameters()) if tensors is None else tensors
    element_size = next(model.parameters()).element_size()
    shape = partial(shard_shape, spec=spec, tp=parallel.tp)
    for bucket in plan_buckets(spec, parallel, critic, bucket_bytes, element_size):
        if rank == exporter:
            shards = _receive_bucket(bucket, params, shape, parallel, replica)
            out: list[tuple[str, torch.Tensor]] = []
            for i, planned in enumerate(bucket):
                full = from_shards(planned.entry, shards[(planned.stage, i)], spec)
                out += [(n, t.cpu()) for n, t in zip(planned.entry.hf_names, full)]
            yield out
        elif coords.dp_rank == replica:
            _send_bucket(bucket, params, coords.pp_rank, exporter)


def gather_entries(entries: list[list[Entry]], tensors: dict[str, torch.Tensor], shape: Callable[[Entry], tuple],
                   spec: ModelSpec, parallel: ParallelDims, replica: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective over all ranks: the full tensors (first HF name -> CPU tensor) of `entries[stage]`
    for every stage, on the first shard of replica `replica` (None elsewhere). `tensors` holds this
    rank's shards by Megatron name; `shape(entry)` is one shard's shape. Used for LoRA adapters
    (and their gradients), which are small enough for one bucket."""
    bucket = [Planned(stage, e) for stage, in_stage in enumerate(entries) for e in in_stage]
    rank, exporter = dist.get_rank(), parallel.rank_of(0, 0, replica)
    coords = parallel.coords(rank)
    if rank == exporter:
        shards = _receive_bucket(bucket, tensors, shape, parallel, replica)
        return {p.entry.hf_names[0]: from_shards(p.entry, shards[(p.stage, i)], spec)[0].cpu()
                for i, p in enumerate(bucket)}
    if coords.dp_rank == replica:
        _send_bucket(bucket, tensors, coords.pp_rank, exporter)
    return None
