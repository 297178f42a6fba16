"""The CUDA IPC handoff of a weight sync: the actor and the rollout on one GPU. Both halves: the
sender's `IpcRing`, the receivers' `open_handle` and `views`.

Checksum family: "pw64" (`FAMILY`, the position-weighted sum of `xray/transport/wire.py`), named
by the sender in every checksum of the layout and computed on the GPU by both ends, on each
tensor's bytes in the shared buffer: the bytes never leave the GPU. A receiver handed another
family raises (`wire.changed`). The CPU tests of the layout run the same family on a CPU buffer.

One of the transports of a weight sync (`sync.transport`: "ipc"; `auto` takes it when
every rollout shard runs on the exporting shard's own GPU, as in `configs/ppo_gpu_1x.yaml`). NCCL
cannot join two processes on one GPU into a group ("Duplicate GPU detected", seen on an H100), and
the object store would move every byte GPU -> host -> GPU. Here the exporting shard of the actor
keeps a ring of two GPU buffers: it copies each bucket's tensors into the next buffer, device to
device (the flat form, `wire.pack_into`), and sends every rollout shard the buffer's CUDA IPC
handle (torch's own, as `torch.multiprocessing` shares a CUDA tensor) with the bucket's layout and
each tensor's checksum; each shard opens the handle, views its tensors in the actor's memory
without a copy, checks the checksums and loads them. The GPU counterpart of the shared-memory
slots (`xray/transport/shm.py`).

A buffer is written again only after every shard has loaded the bucket it held (`push_weights`
keeps at most two buckets in flight), and a shard keeps no view of it after its load. The layout
and the checksummed views are plain functions (`pack_into`, `views`), tested on the CPU; the
handles need a GPU (the GPU tier runs them).
"""
from __future__ import annotations

import torch

from xray.backends.base import WeightBucket
from xray.transport import faults, wire
from xray.transport.wire import FlatLayout, PW64, layout_size

SLOTS = 2
FAMILY = PW64
"""The checksum family of this transport: computed on the GPU, where both ends hold the bytes."""

IpcLayout = FlatLayout


def pack_into(buffer: torch.Tensor, bucket: WeightBucket, corrupt: str | None = None,
              checksums: bool = True) -> IpcLayout:
    """Copy `bucket`'s tensors into the uint8 `buffer` at aligned offsets; their layout, each with
    the "pw64" checksum of its bytes (None without `checksums`: an unverified sync). `corrupt`
    breaks the bucket after its checksums were taken (`xray/transport/faults.py`: fault injection
    for testing the verification, never set in a run)."""
    layout = wire.pack_into(buffer, bucket, FAMILY, checksums)
    return faults.in_buffer(buffer, layout, corrupt)


def views(whole: torch.Tensor, layout: IpcLayout) -> tuple[WeightBucket, list[str]]:
    """The tensors of `layout` viewing the uint8 `whole` (no copy), and the names of those whose
    bytes no longer match their checksum, recomputed where `whole` lies in "pw64"."""
    return wire.views(whole, layout, FAMILY)


class IpcRing:
    """The exporting shard's GPU buffers (one ring per set of targets) and their handles."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.loads: list[list] = [[] for _ in range(SLOTS)]
        """The pending loads of each buffer's last bucket (the writer waits for them before reuse)."""
        self.next = 0

    def write(self, bucket: WeightBucket, corrupt: str | None = None,
              checksums: bool = True) -> tuple[int, tuple, IpcLayout]:
        """Copy `bucket` into the next buffer; (slot, its CUDA IPC handle, layout)."""
        from torch.multiprocessing.reductions import reduce_tensor

        size = layout_size(bucket)
        slot, self.next = self.next, (self.next + 1) % SLOTS
        held = self.buffers[slot]
        if held is None or held.numel() < size:
            self.buffers[slot] = held = None  # free the smaller one first
            self.buffers[slot] = held = torch.empty(size, dtype=torch.uint8, device=self.device)
        layout = pack_into(held, bucket, corrupt, checksums)
        torch.cuda.current_stream(self.device).synchronize()  # the bytes are in place before anyone reads
        _, handle = reduce_tensor(held)
        return slot, handle, layout

    def close(self) -> None:
        self.buffers = [None] * SLOTS


def open_handle(handle: tuple) -> torch.Tensor:
    """The actor's uint8 buffer behind `handle` (from `IpcRing.write`), opened on this process's
    current GPU (the same physical GPU: `auto` checks the devices' UUIDs before it picks "ipc"),
    whatever index this process's CUDA_VISIBLE_DEVICES gives it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle)
    args[6] = torch.cuda.current_device()  # storage_device: the index in this process
    return rebuild_cuda_tensor(*args)


def gpu_uuid() -> str | None:
    """This process's current GPU's UUID (None without CUDA): two processes share a GPU exactly
    when their UUIDs match, whatever indices CUDA_VISIBLE_DEVICES gives them."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
