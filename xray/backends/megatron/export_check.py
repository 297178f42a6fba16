"""The Megatron export's digest check: each shard's digest, taken before the gather, in HF coordinates.

Called by `export.export_full` at the start of every export (`xray/backends/export_digest.py`
defines the digest and the verdict). Every rank digests the shards it holds of every exported
entry, each piece placed where it lands in its Hugging Face tensor, by a mapping of its own (not
`convert.from_shards`, the gather's): column-parallel rows at tp_rank * rows, row-parallel
columns at tp_rank * columns, a fused QKV shard cut into its kv groups' q, k and v rows, a fused
gate/up shard into its gate and up halves. One all-reduce of a small int64 table
[dp, HF tensors, tp, 3] (each cell filled by the one rank that holds that piece) gives every rank
every replica's digests: the replicas are compared with the exporting one (a diverged replica is
named by rank), and the exporting rank compares each tensor it gathered with its shards' digest.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from xray.backends.export_digest import ExportCheck, combine, digest
from xray.backends.megatron.convert import Entry, Kind
from xray.backends.megatron.spec import ModelSpec
from xray.config.parallel import ParallelDims

Piece = tuple[int, torch.Tensor, int, int]
"""(index in `entry.hf_names`, the piece, its first row, its first column in that HF tensor)."""


def pieces(entry: Entry, shard: torch.Tensor, spec: ModelSpec, tp_rank: int) -> list[Piece]:
    """The pieces of tp shard `tp_rank` of `entry`, each placed in its HF tensor."""
    if entry.kind is Kind.REPLICATED:
        return [(0, shard, 0, 0)]
    if entry.kind is Kind.COLUMN:
        return [(0, shard, tp_rank * shard.shape[0], 0)]
    if entry.kind is Kind.ROW:
        return [(0, shard, 0, tp_rank * shard.shape[1])]
    if entry.kind is Kind.GATE_UP:
        half = shard.shape[0] // 2
        return [(0, shard[:half], tp_rank * half, 0), (1, shard[half:], tp_rank * half, 0)]
    if entry.kind is Kind.QKV:
        d, per_group, rest = spec.head_dim, spec.num_heads // spec.num_kv_heads, shard.shape[1:]
        groups = shard.shape[0] // ((per_group + 2) * d)
        fused = shard.reshape(groups, per_group + 2, d, *rest)
        q = fused[:, :per_group].reshape(-1, *rest)
        k, v = (fused[:, per_group + i].reshape(-1, *rest) for i in (0, 1))
        return [(0, q, tp_rank * q.shape[0], 0), (1, k, tp_rank * k.shape[0], 0), (2, v, tp_rank * v.shape[0], 0)]
    raise AssertionError(entry.kind)


def shard_digests(planned: list, params: Mapping[str, torch.Tensor], spec: ModelSpec, parallel: ParallelDims,
                  replica: int, source, verdict: ExportCheck) -> list[torch.Tensor]:
    """Collective over all ranks: each exported HF tensor's digest (in plan order, the names of
    each entry in turn) combined from the shards of replica `replica`; the replicas that hold
    any piece otherwise than `replica` are recorded in `verdict.diverged`."""
    coords = parallel.coords(dist.get_rank())
    mine = (coords.pp_rank, coords.dp_rank)
    names = [(name, p) for p in planned for name in p.entry.hf_names]
    table = torch.zeros(parallel.dp, len(names), parallel.tp, 3, dtype=torch.int64)
    row = 0
    for p in planned:
        holders = [d for d in range(parallel.dp) if source(p, d) == mine]
        if holders:
            for index, piece, row0, col0 in pieces(p.entry, params[p.entry.megatron_name], spec, coords.tp_rank):
                table[holders, row + index, coords.tp_rank] = digest(piece, row0, col0)
        row += len(p.entry.hf_names)
    device = next(iter(params.values())).device
    summed = table.to(device)
    dist.all_reduce(summed)
    table = summed.cpu()
    verdict.replicas = parallel.dp
    _compare_replicas(table, names, parallel, replica, source, verdict)
    return [combine(table[replica, i, :1 if p.entry.kind is Kind.REPLICATED else parallel.tp])
            for i, (_, p) in enumerate(names)]


def _compare_replicas(table: torch.Tensor, names: list[tuple], parallel: ParallelDims, replica: int, source,
                      verdict: ExportCheck) -> None:
    """Record in `verdict.diverged` every piece a replica holds otherwise than `replica`, by rank."""
    differs = (table != table[replica]).any(-1)  # [dp, HF tensors, tp]
    for d, i, tp_rank in differs.nonzero().tolist():
        name, p = names[i]
        stage, dp_rank = source(p, d)
        rank = parallel.rank_of(tp_rank, stage, dp_rank)
        verdict.diverged.append(f"rank {rank} (dp_rank {dp_rank}, tp_rank {tp_rank}) holds {name} otherwise "
                                f"than data-parallel replica {replica}")
