"""The shared-memory transport of a weight sync: the actor and the rollout on one CPU node. Both
halves: the sender's `SendRing`, the receivers' `SlotReader`.

Checksum family: "xxh3" (`FAMILY`, XXH3-64 of each tensor's bytes in host memory), taken and
named by the sender on the wire form (`xray.transport.wire.pack_bucket`) and recomputed by each
reader in the slot; a reader handed another family raises (`wire.changed`).

One of the transports of a weight sync (`sync.transport`: "shm"; `auto` takes it when
every rollout shard shares the exporting shard's node on CPU). The exporting shard of the actor
keeps a ring of two slots, files in /dev/shm that it maps once and reuses at every sync: it
copies each bucket's bytes into the next slot and tells every rollout shard where they lie (a small
Ray call: the slot's path and the bucket's layout, with each tensor's checksum); each shard maps
the slot once, views its tensors there without a copy, checks their checksums and loads them.

Why not the object store, which also moves bytes through shared memory: each `ray.put` of a bucket
lands in a part of the store's arena that the two processes have not touched yet, and every page
of it is then faulted in twice, by the writer and by the reader (measured: a 64 MB put takes 6 ms
into pages already mapped and 20-40 ms into fresh ones, 16,400 page faults; a 27M-model sync 120
ms without faults and up to 340 ms with them). The slots are mapped once, so after the first sync
no page faults again. The CPU counterpart of the CUDA IPC handoff a colocated GPU rollout takes.

A slot is written again only after every shard has loaded the bucket it held (`push_weights`
keeps at most two buckets in flight), and an engine keeps no view of it after its load (vLLM's
fused-layer stager clones the parts it holds back). Slot files are named after the writing
process and removed when it shuts down; those of a process that died are removed by the next
ring made on the node.
"""
from __future__ import annotations

import atexit
import mmap
import os
import re
from pathlib import Path

import numpy as np

from xray.backends.base import WeightBucket
from xray.transport.wire import XXH3, Checksum, WireTensor, views

SHM_DIR = Path("/dev/shm")
SLOTS = 2
ALIGN = 64
"""Byte alignment of each tensor in a slot (any dtype views it in place)."""
FAMILY = XXH3
"""The checksum family of this transport: the wire form's, the bytes lying in host memory."""

# One tensor of a slot's layout: (name, torch dtype name, shape, offset, byte count, checksum).
SlotLayout = list[tuple[str, str, tuple[int, ...], int, int, "Checksum | None"]]


def usable(nbytes: int) -> bool:
    """Whether this node's /dev/shm can hold a ring for buckets of `nbytes` (with room to spare: a
    write past a full tmpfs kills the writer with SIGBUS). Docker gives containers 64 MB."""
    if not SHM_DIR.is_dir():
        return False
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize >= 2 * SLOTS * nbytes


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _sweep_dead() -> None:
    """Remove slot files left by processes of this node that are gone."""
    for path in SHM_DIR.glob("xray-sync-*"):
        match = re.match(r"xray-sync-(\d+)-", path.name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            path.unlink(missing_ok=True)


class SendRing:
    """The exporting shard's slots (one ring per set of targets)."""

    def __init__(self, tag: str):
        self.tag = tag
        self.slots: list[tuple[Path, mmap.mmap] | None] = [None] * SLOTS
        self.loads: list[list] = [[] for _ in range(SLOTS)]
        """The pending loads of each slot's last bucket (the writer waits for them before reuse)."""
        self.next = 0
        self.made = 0
        _sweep_dead()
        atexit.register(self.close)

    def write(self, wire: list[WireTensor]) -> tuple[int, str, SlotLayout]:
        """Copy a bucket in its wire form (`pack_bucket`) into the next slot; (slot, path, layout)."""
        layout, offset = [], 0
        for name, dtype, shape, data, sum_ in wire:
            layout.append((name, dtype, shape, offset, data.nbytes, sum_))
            offset = _aligned(offset + data.nbytes)
        slot, self.next = self.next, (self.next + 1) % SLOTS
        path, view = self._slot(slot, max(offset, ALIGN))
        target = np.frombuffer(view, dtype=np.uint8)
        for (_, _, _, start, nbytes, _), entry in zip(layout, wire):
            target[start:start + nbytes] = entry[3]
        return slot, str(path), layout

    def _slot(self, slot: int, size: int) -> tuple[Path, mmap.mmap]:
        """Slot `slot`, made (or made anew, larger) to hold `size` bytes."""
        held = self.slots[slot]
        if held is not None and len(held[1]) >= size:
            return held
        if held is not None:
            self._drop(slot)
        self.made += 1
        path = SHM_DIR / f"xray-sync-{os.getpid()}-{self.tag}-{slot}-{self.made}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC) rather than SIGBUS mid-copy
            self.slots[slot] = (path, mmap.mmap(fd, size))
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return self.slots[slot]

    def _drop(self, slot: int) -> None:
        path, view = self.slots[slot]
        self.slots[slot] = None
        path.unlink(missing_ok=True)
        try:
            view.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
            pass

    def close(self) -> None:
        """Remove the slot files (readers keep their mappings until they drop them)."""
        for slot in range(SLOTS):
            if self.slots[slot] is not None:
                self._drop(slot)


class SlotReader:
    """A rollout shard's mappings of the slots it was sent (each mapped once, kept)."""

    def __init__(self):
        self.maps: dict[int, tuple[str, mmap.mmap]] = {}

    def read(self, slot: int, path: str, layout: SlotLayout) -> tuple[WeightBucket, list[str]]:
        """The bucket in `slot` at `path`: tensors viewing the mapped slot (read-only: load them by
        copying, and keep no view past the load), and the names of those whose bytes do not match
        their checksum."""
        held = self.maps.get(slot)
        if held is None or held[0] != path:
            if held is not None:
                try:
                    held[1].close()
                except BufferError:
                    pass
            fd = os.open(path, os.O_RDONLY)
            try:
                self.maps[slot] = held = (path, mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
            finally:
                os.close(fd)
        return views(np.frombuffer(held[1], dtype=np.uint8), layout, FAMILY)
