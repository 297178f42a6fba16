"""The process-group transport of a weight sync (`sync.transport: pg`): the actor's exporting shard
broadcasts each bucket. Both halves: the sender's `pack` and `send`, the receivers' `receive`,
and `join`.

Checksum family: the family of the group's device (`xray.transport.wire.family_for`), named by
the sender in every checksum of the layout: "pw64" (position-weighted) on a GPU (NCCL), computed
on the device by both ends, the bytes never leaving it; "xxh3" in host memory (gloo on the CPU).
The sender copies the bucket's tensors into one flat buffer on its device (`pack`: the flat form,
`xray/transport/wire.py`) and takes each tensor's checksum there; each receiver receives the
buffer on its device and recomputes the checksums there, in the family the layout names, which
must be its own device's (`wire.changed` raises on any other: the two ends never compare
different families).

`auto` takes it when neither the shared-memory slots nor CUDA IPC fit the placement
(`TrainWorkhorse.push_weights` picks; `xray/sync/weights.py` drives and verifies the sync). The
exporting shard of the actor (rank 0) and every rollout shard (ranks 1..n, all tensor-parallel
ranks of all replicas) join a group of their own, outside each model's
torch.distributed world: a `TCPStore` on the exporting shard's node and a gloo group on CPU, NCCL
on GPU, built directly on that store so that it needs no common default group. A bucket travels as
one flat byte buffer: its layout (names, dtypes, shapes, offsets, byte counts and checksums) and
size go ahead as a small Ray call, then the bytes are broadcast from rank 0; each receiver views
its tensors in the buffer, checks their checksums and loads them (full Hugging Face tensors: each
engine cuts its tensor-parallel shard as it loads, so the actor's and the rollout's tp may differ).

On one machine shared memory (the object store) moves bytes faster than a gloo broadcast (see
FACTS.md); the group pays off across nodes and on GPUs, where NCCL moves device memory directly.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from xray.backends.base import WeightBucket
from xray.transport.wire import FlatLayout, family_for, layout_size, pack_into, views


def join(addr: str, port: int, rank: int, world: int, device: str, timeout_s: float = 120.0):
    """This process's member of a sync group of `world` ranks whose store rank 0 serves at
    addr:port (rank 0 opened that point: `xray/transport/rendezvous.py`); gloo on "cpu", NCCL
    on "cuda"."""
    from xray.transport.rendezvous import store_at

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("xray-sync", store_at(addr, port, world, timeout_s))
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


def pack(bucket: WeightBucket, device: str, checksums: bool = True,
         family: str | None = None) -> tuple[torch.Tensor, FlatLayout]:
    """The sender's half, before `send`: `bucket` copied into one flat uint8 buffer on `device`
    (device to device when the tensors lie there), and its layout with each tensor's checksum
    taken in the buffer in `family` (default: `device`'s, `family_for`; the CPU tests pass "pw64"
    to run the device form on the CPU)."""
    flat = torch.empty(layout_size(bucket), dtype=torch.uint8, device=device)
    return flat, pack_into(flat, bucket, family or family_for(device), checksums)


def send(group, flat: torch.Tensor) -> None:
    """Broadcast a packed bucket's buffer (rank 0)."""
    _broadcast(group, flat)


def receive(group, layout: FlatLayout, size: int, device: str,
            family: str | None = None) -> tuple[WeightBucket, list[str]]:
    """Receive a bucket of `size` bytes broadcast by rank 0 into a buffer on `device`: its tensors
    (views into the buffer) and the names of those whose bytes do not match their checksum,
    computed there in `family` (default: `device`'s, as the sender's `pack`)."""
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    _broadcast(group, flat)
    return views(flat, layout, family or family_for(device))
