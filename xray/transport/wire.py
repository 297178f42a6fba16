"""The forms a weight sync's buckets take on their way and the checksums both ends compute: the
lowest part of every weight-sync transport (`xray/transport`), below the Workhorses that send and
receive.

The wire form (`pack_bucket`), in host memory: each tensor as a flat NumPy byte view (no copy for
a contiguous CPU tensor), with its dtype, shape and a checksum of its bytes; the receiver views
the tensors in those bytes (`unpack_bucket`) and recomputes the checksums (`changed_in_transit`).
This is the whole object-store transport (`sync.transport: objstore`: the sender `ray.put`s the
wire form, which Ray moves out of band; a staged sync always takes it), and the shared-memory
slots (`xray/transport/shm.py`) copy the same form.

The flat form (`pack_into`, `views`), for the transports that keep the bytes on a device (CUDA
IPC, a process group: `ipc.py`, `pg.py`): one uint8 buffer holding every tensor of a bucket at
aligned offsets, its layout (name, dtype, shape, offset, byte count, checksum) sent ahead.

Checksum families, each named by the SENDER in every checksum it sends (`(family, value)`), and
computed by the receiver in the family named, wherever its copy lies (`checksum`):
- "xxh3": XXH3-64 of the bytes in host memory. The wire form's (object store, shared memory, a
  gloo group on the CPU);
- "pw64": a position-weighted sum of the bytes as 64-bit words, computed where they lie
  (`position_weighted`). The flat form's on a device (CUDA IPC, NCCL): no host round trip.
Both see order. Each transport names its family for where its bytes lie (`family_for`), and its
receiver checks that the family named is that one (`changed`): a family it does not know, another
family than its transport's, or a checksum computed in another family than the one named, raises
`WeightSyncError` naming both families, so the two ends can never compare different families.

The sender also lists every tensor it sends (`manifest_of`: name, dtype, shape, byte count), and
each receiver lists what it got the same way, for the completeness check of the driver's
verified sync (`xray/sync/manifest.py`).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from xray.backends.base import WeightBucket
from xray.transport.errors import WeightSyncError

XXH3 = "xxh3"
"""XXH3-64 of the bytes in host memory."""
PW64 = "pw64"
"""The position-weighted sum of the bytes as 64-bit words, computed where they lie."""
FAMILIES = (XXH3, PW64)

Checksum = tuple[str, int]
"""A checksum as it travels: (the family it was computed in, its value)."""

# One tensor on the wire: (Hugging Face name, torch dtype name, shape, its bytes as a flat uint8
# array, the checksum of those bytes or None in an unverified sync).
WireTensor = tuple[str, str, tuple[int, ...], "numpy.ndarray", "Checksum | None"]

# One tensor of a flat buffer's layout: (name, torch dtype name, shape, offset, byte count, checksum).
FlatLayout = list[tuple[str, str, tuple[int, ...], int, int, "Checksum | None"]]


def bytes_tensor(data) -> torch.Tensor:
    """A uint8 tensor viewing a NumPy byte array (read-only memory: never write into it), or the
    uint8 tensor itself."""
    if isinstance(data, torch.Tensor):
        return data
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def family_for(device) -> str:
    """The checksum family of bytes lying on `device` ("cpu", "cuda", a torch.device): "pw64" on a
    device, computed there; "xxh3" in host memory."""
    return XXH3 if torch.device(device).type == "cpu" else PW64


def xxh3(data) -> int:
    """XXH3-64 of a byte array in host memory (a real hash: two rows swapped, bytes shifted by an
    offset, any change of order or value changes it), at memory speed, as fast as a plain sum of
    64-bit words (6.4 ms against 6.2 ms for 108 MB on the developers' CPU)."""
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


def checksum(data, family: str) -> int:
    """The checksum of a byte array (NumPy, or a torch uint8 tensor on any device) in `family`,
    wherever it lies: "xxh3" of a device tensor copies it to host memory first (no transport sends
    that: a device's bytes are named "pw64"), "pw64" of host bytes is computed on the CPU."""
    if family == XXH3:
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            data = data.cpu()
        return xxh3(data)
    if family == PW64:
        return position_weighted(bytes_tensor(data))
    raise WeightSyncError(f"checksum family {family!r} is unknown here (this xray computes {', '.join(FAMILIES)}): "
                          "run the same xray version on the actor and on the rollout")


def sum_of(data, family: str) -> Checksum:
    """The checksum of `data` as it travels, named by its family."""
    return family, checksum(data, family)


def changed(name: str, data, sent: Checksum | None, family: str) -> bool:
    """Whether the bytes `data` of tensor `name` no longer match the checksum `sent`, at a receiver
    of a transport whose family is `family`. A checksum named in another family (or none known),
    or whose value is another family's checksum of these same bytes (a sender that computed one
    family and named another), raises WeightSyncError naming both families."""
    if sent is None:
        return False
    named, value = sent
    where = data.device if isinstance(data, torch.Tensor) else "host memory"
    if named not in FAMILIES:
        raise WeightSyncError(
            f"{name}: the sender named checksum family {named!r}, unknown to this receiver (its transport checks "
            f"{family!r} on bytes in {where}; known: {', '.join(FAMILIES)}): run the same xray version on the actor "
            "and on the rollout")
    if named != family:
        raise WeightSyncError(
            f"{name}: checksum family mismatch: the sender named {named!r}, this receiver's transport checks "
            f"{family!r} on bytes in {where}, so the two ends would compare different families. The sender must "
            "name its transport's family for where the bytes lie (xray.transport.wire.family_for)")
    if checksum(data, named) == value:
        return False
    for other in FAMILIES:
        if other != named and checksum(data, other) == value:
            raise WeightSyncError(
                f"{name}: checksum family mismatch: the sender named {named!r} but sent the {other!r} checksum of "
                f"these bytes: compute the checksum in the family it names (xray.transport.wire.checksum(data, "
                f"{named!r}))")
    return True


def tensor_of(name: str, data, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor `name` viewing its bytes `data` as `dtype` and `shape`; WeightSyncError when the
    byte count does not fit them (the layout and the bytes disagree)."""
    raw = bytes_tensor(data)
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise WeightSyncError(f"{name}: dtype {dtype!r} is not a torch dtype: the sender's layout is broken")
    need = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=kind).element_size()
    if raw.numel() != need:
        raise WeightSyncError(f"{name}: {raw.numel()} bytes arrived for {dtype} {tuple(shape)} ({need} bytes): the "
                              "layout sent ahead does not describe the bytes; fix the sender's layout")
    return raw.view(kind).view(shape)


def pack_bucket(bucket: WeightBucket, checksums: bool = True) -> list[WireTensor]:
    """The wire form of a bucket: byte views of the tensors (no copy for contiguous CPU tensors),
    each with its "xxh3" checksum (the bytes lie in host memory), or None without `checksums` (an
    unverified sync, `sync.verify: false`, whose receiver then checks nothing, `verified`)."""
    wire = []
    for name, tensor in bucket:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        wire.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data,
                     sum_of(data, XXH3) if checksums else None))
    return wire


def verified(layout: list) -> bool:
    """Whether a bucket's wire form or layout carries checksums (the last field of each entry):
    the receiver checks it (checksums, what the engine holds) only then."""
    return all(entry[-1] is not None for entry in layout)


def unpack_bucket(wire: list[WireTensor]) -> WeightBucket:
    """Tensors viewing the wire's bytes (read-only object-store memory on the receiving side:
    load them by copying, never write into them)."""
    return [(name, tensor_of(name, data, dtype, shape)) for name, dtype, shape, data, _ in wire]


def changed_in_transit(wire: list[WireTensor]) -> list[str]:
    """Names of the tensors of a bucket in its wire form whose bytes no longer match their
    checksum (the wire form's family, "xxh3": `changed`)."""
    return [name for name, _, _, data, sent in wire if changed(name, data, sent, XXH3)]


ALIGN = 256
"""Byte alignment of each tensor in a flat buffer (any dtype views it in place; CUDA's own)."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_size(bucket: WeightBucket) -> int:
    """Bytes a flat buffer needs to hold `bucket` at aligned offsets."""
    size = 0
    for _, tensor in bucket:
        size = _aligned(size + tensor.numel() * tensor.element_size())
    return max(size, ALIGN)


def pack_into(buffer: torch.Tensor, bucket: WeightBucket, family: str, checksums: bool = True) -> FlatLayout:
    """Copy `bucket`'s tensors into the uint8 `buffer` at aligned offsets (device to device where
    both lie on one); their layout, each with the checksum of its bytes in `buffer` in `family`
    (None without `checksums`)."""
    layout, offset = [], 0
    for name, tensor in bucket:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        piece = buffer[offset:offset + data.numel()]
        piece.copy_(data, non_blocking=True)
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, data.numel(),
                       sum_of(piece, family) if checksums else None))
        offset = _aligned(offset + data.numel())
    return layout


def views(whole, layout: FlatLayout, family: str) -> tuple[WeightBucket, list[str]]:
    """The tensors of `layout` viewing the uint8 buffer `whole` (a torch tensor, or a numpy array over
    shared memory: no copy), and the names of those whose bytes no longer match their checksum,
    computed where `whole` lies in `family`, the transport's (`changed`)."""
    bucket, moved = [], []
    for name, dtype, shape, start, nbytes, sent in layout:
        piece = whole[start:start + nbytes]
        if changed(name, piece, sent, family):
            moved.append(name)
        bucket.append((name, tensor_of(name, piece, dtype, shape)))
    return bucket, moved


Manifest = list[tuple[str, str, tuple[int, ...], int]]
"""One entry per tensor sent (or received): (Hugging Face name, torch dtype name, shape, byte count)."""


def manifest_of(bucket: WeightBucket) -> Manifest:
    """The manifest entries of one bucket: what the sender sends, and what a receiver got."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for name, t in bucket]
