"""The process-group transport of a weight sync (`sync.transport: pg`): the actor's exporting shard
broadcasts each bucket. Both halves: the sender's `send`, the receivers' `receive`, and `join`.

Checksum family: `xray.transport.wire.checksum`. The sender's checksums are those of the
bucket's wire form (`pack_bucket`: XXH3-64 of the host bytes), sent ahead in the layout; each
receiver recomputes `checksum` where the buffer lies: XXH3-64 on the CPU (gloo), the same family,
but the position-weighted sum on a GPU (NCCL), which is not the sender's: over NCCL a verified
push would report every tensor changed in transit (never run here: it needs two GPUs).

`auto` takes it when neither the shared-memory slots nor CUDA IPC fit the placement
(`TrainWorkhorse.push_weights` picks; `xray/sync/weights.py` drives and verifies the sync). The
exporting shard of the actor (rank 0) and every rollout shard (ranks 1..n, all tensor-parallel
ranks of all replicas) join a group of their own, outside each model's
torch.distributed world: a `TCPStore` on the exporting shard's node and a gloo group on CPU, NCCL
on GPU, built directly on that store so that it needs no common default group. A bucket travels as
one flat byte buffer: its layout (names, dtypes, shapes, byte counts and checksums) goes ahead as
a small Ray call, then the bytes are broadcast from rank 0; each receiver views its tensors in
the buffer, checks their checksums and loads them (full Hugging Face tensors: each engine cuts
its tensor-parallel shard as it loads, so the actor's and the rollout's tp may differ).

On one machine shared memory (the object store) moves bytes faster than a gloo broadcast (see
FACTS.md); the group pays off across nodes and on GPUs, where NCCL moves device memory directly.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from xray.backends.base import WeightBucket
from xray.transport.wire import checksum

# One tensor of a bucket's layout: (name, torch dtype name, shape, byte count, checksum of the bytes).
Layout = list[tuple[str, str, tuple[int, ...], int, int]]


def join(addr: str, port: int, rank: int, world: int, device: str, timeout_s: float = 120.0):
    """This process's member of a sync group of `world` ranks whose store rank 0 serves at
    addr:port (rank 0 creates it); gloo on "cpu", NCCL on "cuda"."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("xray-sync", dist.TCPStore(addr, port, world, rank == 0, timeout=timeout))
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def layout_of(bucket: WeightBucket, checksums: list[int]) -> Layout:
    """The layout that goes ahead of a bucket's bytes."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size(), c)
            for (name, t), c in zip(bucket, checksums)]


def send(group, bucket: WeightBucket, device: str) -> None:
    """Broadcast the bytes of `bucket` (rank 0), one flat buffer on `device`."""
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for _, t in bucket])
    _broadcast(group, flat)


def receive(group, layout: Layout, device: str) -> tuple[WeightBucket, list[str]]:
    """Receive a bucket broadcast by rank 0: its tensors (views into one buffer on `device`) and
    the names of those whose bytes do not match their checksum."""
    flat = torch.empty(sum(n for _, _, _, n, _ in layout), dtype=torch.uint8, device=device)
    _broadcast(group, flat)
    bucket, changed, start = [], [], 0
    for name, dtype, shape, nbytes, sent in layout:
        piece = flat[start:start + nbytes]
        bucket.append((name, piece.view(getattr(torch, dtype)).view(shape)))
        if sent is not None and checksum(piece) != sent:
            changed.append(name)
        start += nbytes
    return bucket, changed
