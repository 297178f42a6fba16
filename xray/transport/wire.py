"""The wire form of a weight sync's buckets and the checksums both ends compute: the lowest part of
every weight-sync transport (`xray/transport`), below the Workhorses that send and receive.

A bucket travels as `pack_bucket` gives it: each tensor as a flat NumPy byte view (no copy for a
contiguous CPU tensor), with its dtype, shape and a checksum of its bytes; the receiver views the
tensors in those bytes (`unpack_bucket`) and recomputes the checksums (`changed_in_transit`). This
is the whole object-store transport (`sync.transport: objstore`: the sender `ray.put`s the wire
form, which Ray moves out of band; a staged sync always takes it), and the shared-memory slots
(`xray/transport/shm.py`) copy the same form.

Checksum family (`checksum`): XXH3-64 of the bytes in host memory (the object store, the
shared-memory slots, gloo); a position-weighted sum computed on the GPU where both ends hold the
bytes there (CUDA IPC, NCCL: `position_weighted`). Both see order. The sender also lists every
tensor it sends (`manifest_of`), for the completeness check of the driver's verified sync
(`xray/sync/manifest.py`).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from xray.backends.base import WeightBucket

# One tensor on the wire: (Hugging Face name, torch dtype name, shape, its bytes as a flat uint8
# array, the checksum of those bytes).
WireTensor = tuple[str, str, tuple[int, ...], "numpy.ndarray", int]


def bytes_tensor(data) -> torch.Tensor:
    """A uint8 tensor viewing a NumPy byte array (read-only memory: never write into it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def checksum(data) -> int:
    """An order-sensitive checksum of a byte array (NumPy, or a torch uint8 tensor on any device).

    In host memory: XXH3-64 of the bytes (a real hash: two rows swapped, bytes shifted by an
    offset, any change of order or value changes it), at memory speed, as fast as a plain sum of
    64-bit words (6.4 ms against 6.2 ms for 108 MB on the developers' CPU). In GPU memory (the
    CUDA IPC and NCCL transports, whose two ends both hold the bytes on a GPU): a position-weighted
    sum computed there, `position_weighted`."""
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return position_weighted(data)
    import xxhash

    array = data.numpy() if isinstance(data, torch.Tensor) else data
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


CHECKSUM_BLOCK = 512
"""Words per block of `position_weighted`."""


def position_weighted(data: torch.Tensor) -> int:
    """A checksum of a uint8 tensor that sees order, computed where the tensor lives: its bytes as
    64-bit words w_i (the last < 8 bytes and the words past the last whole block of
    `CHECKSUM_BLOCK` on their own), sum(w_i) + K x sum((i + 1) w_i) modulo 2^64 (K odd), the
    weighted sum taken as block sums weighted by block and column sums weighted by column. Two
    words swapped change it unless they hold the same value."""
    whole = data.numel() // 8 * 8
    head = data[:whole] if data.storage_offset() % 8 == 0 else data[:whole].clone()
    words = head.view(torch.int64)
    blocks = words.numel() // CHECKSUM_BLOCK
    grid = words[:blocks * CHECKSUM_BLOCK].view(blocks, CHECKSUM_BLOCK)
    rows, cols = grid.sum(1), grid.sum(0)
    rest = words[blocks * CHECKSUM_BLOCK:]
    at = lambda n, start: torch.arange(start, start + n, device=data.device, dtype=torch.int64)  # noqa: E731
    weighted = (CHECKSUM_BLOCK * (rows * at(blocks, 0)).sum() + (cols * at(CHECKSUM_BLOCK, 1)).sum()
                + (rest * at(rest.numel(), blocks * CHECKSUM_BLOCK + 1)).sum())
    plain = words.sum() + data[whole:].to(torch.int64).sum()
    return (int(plain) + 0x9E3779B97F4A7C15 * int(weighted)) % 2**64


def pack_bucket(bucket: WeightBucket, checksums: bool = True) -> list[WireTensor]:
    """The wire form of a bucket: byte views of the tensors (no copy for contiguous CPU tensors),
    each with its checksum (None without `checksums`: an unverified sync, `sync.verify: false`,
    whose receiver then checks nothing, `verified`)."""
    wire = []
    for name, tensor in bucket:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        wire.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data,
                     checksum(data) if checksums else None))
    return wire


def verified(layout: list) -> bool:
    """Whether a bucket's wire form or layout carries checksums (the last field of each entry):
    the receiver checks it (checksums, what the engine holds) only then."""
    return all(entry[-1] is not None for entry in layout)


def unpack_bucket(wire: list[WireTensor]) -> WeightBucket:
    """Tensors viewing the wire's bytes (read-only object-store memory on the receiving side:
    load them by copying, never write into them)."""
    return [(name, bytes_tensor(data).view(getattr(torch, dtype)).view(shape))
            for name, dtype, shape, data, _ in wire]


def changed_in_transit(wire: list[WireTensor]) -> list[str]:
    """Names of the tensors whose bytes no longer match their checksum."""
    return [name for name, _, _, data, sent in wire if sent is not None and checksum(data) != sent]


Manifest = list[tuple[str, str, tuple[int, ...], int]]
"""One entry per tensor sent: (Hugging Face name, torch dtype name, shape, byte count)."""


def manifest_of(bucket: WeightBucket) -> Manifest:
    """The manifest entries of one bucket."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for name, t in bucket]
