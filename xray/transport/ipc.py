"""The CUDA IPC handoff of a weight sync: the actor and the rollout on one GPU. Both halves: the
sender's `IpcRing`, the receivers' `open_handle` and `views`.

Checksum family: `xray.transport.wire.checksum` of each tensor's bytes in the GPU buffer, the
position-weighted sum on the GPU (the bytes never leave it); XXH3-64 when the buffer is in host
memory (the CPU tests of the layout).

One of the transports of a weight sync (`sync.transport`: "ipc"; `auto` takes it when
every rollout shard runs on the exporting shard's own GPU, as in `configs/ppo_gpu_1x.yaml`). NCCL
cannot join two processes on one GPU into a group ("Duplicate GPU detected", seen on an H100), and
the object store would move every byte GPU -> host -> GPU. Here the exporting shard of the actor
keeps a ring of two GPU buffers: it copies each bucket's tensors into the next buffer, device to
device, and sends every rollout shard the buffer's CUDA IPC handle (torch's own, as
`torch.multiprocessing` shares a CUDA tensor) with the bucket's layout and each tensor's checksum;
each shard opens the handle, views its tensors in the actor's memory without a copy, checks the
checksums and loads them. The GPU counterpart of the shared-memory slots (`xray/transport/shm.py`).

A buffer is written again only after every shard has loaded the bucket it held (`push_weights`
keeps at most two buckets in flight), and a shard keeps no view of it after its load. The layout
and the checksummed views are plain functions (`pack_into`, `views`), tested on the CPU; the
handles need a GPU (the GPU tier runs them).
"""
from __future__ import annotations

import torch

from xray.backends.base import WeightBucket
from xray.transport.wire import checksum

SLOTS = 2
ALIGN = 256
"""Byte alignment of each tensor in a buffer (any dtype views it in place; CUDA's own alignment)."""

# One tensor of a buffer's layout: (name, torch dtype name, shape, offset, byte count, checksum).
IpcLayout = list[tuple[str, str, tuple[int, ...], int, int, int]]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_size(bucket: WeightBucket) -> int:
    """Bytes a buffer needs to hold `bucket` at aligned offsets."""
    size = 0
    for _, tensor in bucket:
        size = _aligned(size + tensor.numel() * tensor.element_size())
    return max(size, ALIGN)


def pack_into(buffer: torch.Tensor, bucket: WeightBucket, corrupt: str | None = None) -> IpcLayout:
    """Copy `bucket`'s tensors into the uint8 `buffer` at aligned offsets; their layout, each with
    the checksum of its bytes. `corrupt` names a tensor changed by +1e-2 after its checksum was
    taken (fault injection for testing the verification, never set in a run)."""
    layout, offset = [], 0
    for name, tensor in bucket:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        piece = buffer[offset:offset + data.numel()]
        piece.copy_(data, non_blocking=True)
        sent = checksum(piece)
        if name == corrupt:
            changed = (tensor.detach().to(buffer.device) + 1e-2).to(tensor.dtype)
            piece.copy_(changed.contiguous().reshape(-1).view(torch.uint8))
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                       data.numel(), sent))
        offset = _aligned(offset + data.numel())
    return layout


def views(whole: torch.Tensor, layout: IpcLayout) -> tuple[WeightBucket, list[str]]:
    """The tensors of `layout` viewing the uint8 `whole` (no copy), and the names of those whose
    bytes no longer match their checksum."""
    bucket, changed = [], []
    for name, dtype, shape, start, nbytes, sent in layout:
        piece = whole[start:start + nbytes]
        if checksum(piece) != sent:
            changed.append(name)
        bucket.append((name, piece.view(getattr(torch, dtype)).view(shape)))
    return bucket, changed


class IpcRing:
    """The exporting shard's GPU buffers (one ring per set of targets) and their handles."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * SLOTS
        self.loads: list[list] = [[] for _ in range(SLOTS)]
        """The pending loads of each buffer's last bucket (the writer waits for them before reuse)."""
        self.next = 0

    def write(self, bucket: WeightBucket, corrupt: str | None = None) -> tuple[int, tuple, IpcLayout]:
        """Copy `bucket` into the next buffer; (slot, its CUDA IPC handle, layout)."""
        from torch.multiprocessing.reductions import reduce_tensor

        size = layout_size(bucket)
        slot, self.next = self.next, (self.next + 1) % SLOTS
        held = self.buffers[slot]
        if held is None or held.numel() < size:
            self.buffers[slot] = held = None  # free the smaller one first
            self.buffers[slot] = held = torch.empty(size, dtype=torch.uint8, device=self.device)
        layout = pack_into(held, bucket, corrupt)
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
