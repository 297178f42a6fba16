"""The DeepSpeed export's digest check: what each rank holds, before ZeRO-3's gather, against the export.

Called by `export.iter_weight_buckets` at the start of every export (`xray/backends/export_digest.py`
defines the digest and the verdict). Every HF tensor is digested flat (its elements in storage
order: one column), so a ZeRO-3 partition (elements [rank * size, (rank + 1) * size) of the
flattened parameter, padding cut off) is a piece placed at its first element. One all-gather of
a small int64 table [world, HF tensors, 3] follows:
- ZeRO stages 1 and 2 keep every parameter whole on every rank: the ranks are data-parallel
  replicas and must hold the same bits (a diverged rank is named); the exporting rank's digest
  is the one its export must match;
- ZeRO-3 partitions every parameter: the partitions' digests combine into the tensor's, which
  the gathered tensor must match (no replicas to compare).
A LoRA-adapted weight is exported merged (W + scaling B A), which no digest of its pieces
predicts: its pieces are compared over the replicas, and the merged tensor is counted unchecked.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from xray.backends.export_digest import ExportCheck, combine, digest

Unit = tuple[str, list[torch.nn.Parameter]]


def _local(param: torch.nn.Parameter, zero3: bool) -> torch.Tensor:
    """The digest of what this rank holds of `param`: all of it, or its ZeRO-3 partition."""
    if not zero3:
        return digest(param.detach().reshape(-1))
    part = param.ds_tensor
    size = int(part.ds_numel)
    start = size * dist.get_rank(group=param.ds_process_group)
    valid = max(0, min(size, int(param.ds_numel) - start))
    return digest(part.detach().reshape(-1)[:valid], row0=start)


def shard_digests(units: list[Unit], zero3: bool, replica: int, verdict: ExportCheck) -> list[torch.Tensor | None]:
    """Collective over all ranks: each unit's expected digest in `units` order (None for a merged
    LoRA unit), the replicas compared on stages 1 and 2 (`verdict.diverged`)."""
    table = torch.stack([combine(torch.stack([_local(p, zero3) for p in params])) if len(params) > 1
                         else _local(params[0], zero3) for _, params in units])
    device = units[0][1][0].device
    gathered = [torch.empty_like(table, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, table.to(device))
    every = torch.stack([g.cpu() for g in gathered])  # [world, units, 3]
    if zero3:
        expected = combine(every.transpose(0, 1))
    else:
        verdict.replicas = every.shape[0]
        for rank, i in (every != every[replica]).any(-1).nonzero().tolist():
            verdict.diverged.append(f"rank {rank} (dp_rank {rank}) holds {units[i][0]} otherwise than "
                                    f"data-parallel replica {replica}")
        expected = every[replica]
    return [None if len(params) > 1 else expected[i] for i, (_, params) in enumerate(units)]
