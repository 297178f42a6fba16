"""Streaming the full weights, with Hugging Face names, from one replica's shards to its first.

Used by `MegatronEngine.export_weights` (weight sync to the rollout engine, HF checkpoints). Every
rank computes the same plan from the model spec alone: the exported entries of every pipeline
stage in order, cut into buckets of bounded size. For each bucket, each shard of the exporting
data-parallel replica (the first, unless asked) that holds part of it packs its pieces into one
flat buffer and sends it to that replica's first rank (point-to-point, so ranks that hold nothing
of a bucket stay idle; with expert parallelism the replica's expert-parallel peers send the
experts they hold), which unpacks the buffers, rebuilds the HF tensors with
`convert.from_shards` and yields them. With LoRA the adapted weights are exported merged (the
engine passes their merged shards), and `gather_entries` brings the adapter tensors themselves
(`lora.py`'s entries, `peft` names) to the same rank in one piece. Before the first bucket, every
rank digests its shards (`export_check.py`): the replicas are compared, and each tensor the
exporting rank rebuilds is judged against its shards' digest before it is yielded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from xray.backends.expert_names import bucketed
from xray.backends.export_digest import ExportCheck, judge
from xray.backends.megatron.convert import Entry, Kind, from_shards, shard_shape, stage_entries
from xray.backends.megatron.export_check import shard_digests
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
    under `bucket_bytes` (an entry larger than that is its own bucket), an MoE block's entries
    (router, experts, shared expert) never cut apart (`expert_names.bucketed`)."""
    planned = [Planned(stage, entry) for stage in range(parallel.pp)
               for entry in stage_entries(spec, stage, parallel.pp, critic, ep=parallel.ep) if entry.exported]

    def nbytes(p: Planned) -> int:
        copies = 1 if p.entry.kind is Kind.REPLICATED else parallel.tp
        return _numel(p.entry, spec, parallel.tp) * copies * element_size

    return bucketed(planned, lambda p: p.entry.hf_names[0], nbytes, bucket_bytes)


def _numel(entry: Entry, spec: ModelSpec, tp: int) -> int:
    return math.prod(shard_shape(entry, spec, tp))


def _source(planned: Planned, spec: ModelSpec, parallel: ParallelDims, replica: int) -> tuple[int, int]:
    """(pipeline stage, data-parallel rank) of the shards holding `planned` for replica `replica`:
    the replica's own, or for a routed expert the member of its expert-parallel group that holds it."""
    expert = planned.entry.expert
    dp = replica if expert is None else parallel.expert_owner(replica, expert, spec.num_experts)
    return planned.stage, dp


def _source_of(planned: Planned, replica: int, spec: ModelSpec, parallel: ParallelDims) -> tuple[int, int]:
    """`_source` with the replica second: the form `export_check.shard_digests` calls."""
    return _source(planned, spec, parallel, replica)


def _send_bucket(bucket: list[Planned], params: Mapping[str, torch.Tensor], mine: tuple[int, int], dst: int,
                 spec: ModelSpec, parallel: ParallelDims, replica: int) -> None:
    """This rank's pieces of `bucket` (those whose source is `mine`), in one buffer to `dst`."""
    pieces = [params[p.entry.megatron_name].detach().reshape(-1) for p in bucket
              if _source(p, spec, parallel, replica) == mine]
    if pieces:
        dist.send(torch.cat(pieces), dst=dst)


def _receive_bucket(bucket: list[Planned], params: Mapping[str, torch.Tensor], shape: Callable[[Entry], tuple],
                    spec: ModelSpec, parallel: ParallelDims, replica: int) -> dict[int, list[torch.Tensor]]:
    """The exporting rank: the shards of every entry of the bucket in tp order, keyed by index
    in the bucket; `shape` gives the shape of one shard of an entry."""
    shards: dict[int, list[torch.Tensor]] = {}
    first = next(iter(params.values()))
    dtype, device = first.dtype, first.device
    sources = [_source(p, spec, parallel, replica) for p in bucket]
    for stage, dp in sorted(set(sources)):
        indexed = [(i, p.entry) for i, p in enumerate(bucket) if sources[i] == (stage, dp)]
        for tp_rank in range(parallel.tp):
            src = parallel.rank_of(tp_rank, stage, dp)
            if src == dist.get_rank():
                pieces = [params[e.megatron_name].detach().clone() for _, e in indexed]
            else:
                sizes = [math.prod(shape(e)) for _, e in indexed]
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                dist.recv(flat, src=src)
                pieces = [t.view(shape(e)) for t, (_, e) in zip(flat.split(sizes), indexed)]
            for (i, _), piece in zip(indexed, pieces):
                shards.setdefault(i, []).append(piece)
    return shards


def _sends_for(coords, parallel: ParallelDims, replica: int) -> bool:
    """Whether a rank at `coords` holds part of replica `replica`'s weights: the replica's own
    shards, and with expert parallelism its expert-parallel peers (their experts)."""
    return coords.dp_rank // parallel.ep == replica // parallel.ep


def export_full(model: torch.nn.Module, spec: ModelSpec, parallel: ParallelDims, critic: bool,
                bucket_bytes: int, replica: int = 0, tensors: Mapping[str, torch.Tensor] | None = None,
                verdict: ExportCheck | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective over all ranks: the first shard of data-parallel replica `replica` (global rank
    0 for replica 0) yields buckets of (HF name, full CPU tensor); that replica's other shards
    (and its expert-parallel peers, for their experts) send it their pieces, and every other rank
    yields nothing. `tensors` (Megatron name -> this rank's shard; default: the model's
    parameters) is what is read (LoRA: merged weights). With `verdict`, every rank first digests
    its shards and the replicas are compared (`export_check.py`), and the exporting rank judges
    each tensor it gathered against its shards' digest before yielding it."""
    rank = dist.get_rank()
    coords = parallel.coords(rank)
    exporter = parallel.rank_of(0, 0, replica)
    params = dict(model.named_parameters()) if tensors is None else tensors
    element_size = next(model.parameters()).element_size()
    shape = partial(shard_shape, spec=spec, tp=parallel.tp)
    buckets = plan_buckets(spec, parallel, critic, bucket_bytes, element_size)
    expected = iter(())
    if verdict is not None:
        source = partial(_source_of, spec=spec, parallel=parallel)
        expected = iter(shard_digests([p for b in buckets for p in b], params, spec, parallel, replica, source,
                                      verdict))
    for bucket in buckets:
        if rank == exporter:
            shards = _receive_bucket(bucket, params, shape, spec, parallel, replica)
            out: list[tuple[str, torch.Tensor]] = []
            for i, planned in enumerate(bucket):
                full = from_shards(planned.entry, shards[i], spec)
                if verdict is not None:
                    for n, t in zip(planned.entry.hf_names, full):
                        judge(n, t, next(expected), verdict)
                out += [(n, t.cpu()) for n, t in zip(planned.entry.hf_names, full)]
            yield out
        elif _sends_for(coords, parallel, replica):
            _send_bucket(bucket, params, (coords.pp_rank, coords.dp_rank), exporter, spec, parallel, replica)


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
        shards = _receive_bucket(bucket, tensors, shape, spec, parallel, replica)
        return {p.entry.hf_names[0]: from_shards(p.entry, shards[i], spec)[0].cpu() for i, p in enumerate(bucket)}
    if coords.dp_rank == replica:
        _send_bucket(bucket, tensors, (coords.pp_rank, coords.dp_rank), exporter, spec, parallel, replica)
    return None
