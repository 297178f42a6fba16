"""The shared-memory transport's slots (`xray/transport/shm.py`), in one process, without Ray."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from xray.transport import shm
from xray.transport.faults import in_transit
from xray.transport.wire import pack_bucket

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")]


def bucket(seed: int, rows: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a.weight", torch.randn(rows, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.weight", torch.randint(0, 9, (2, 3), generator=g))]


def test_buckets_arrive_bit_equal_through_two_reused_slots():
    ring, reader = shm.SendRing("t"), shm.SlotReader()
    try:
        paths = []
        for seed in range(5):
            sent = bucket(seed)
            slot, path, layout = ring.write(pack_bucket(sent))
            assert slot == seed % shm.SLOTS and all(start % shm.ALIGN == 0 for *_, start, _, _ in layout)
            got, changed = reader.read(slot, path, layout)
            assert changed == [] and [n for n, _ in got] == [n for n, _ in sent]
            for (_, a), (_, b) in zip(got, sent):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            paths.append(path)
        assert len(set(paths)) == shm.SLOTS  # each slot made once, then reused
        assert ring.made == shm.SLOTS
    finally:
        ring.close()
    assert not any(Path(p).exists() for p in paths)  # closing removes the files


def test_a_larger_bucket_remakes_its_slot_and_a_change_is_caught():
    ring, reader = shm.SendRing("t"), shm.SlotReader()
    try:
        _, first, _ = ring.write(pack_bucket(bucket(0)))
        ring.write(pack_bucket(bucket(1)))
        slot, path, layout = ring.write(pack_bucket(bucket(2, rows=400)))
        assert slot == 0 and path != first and not Path(first).exists()
        got, changed = reader.read(slot, path, layout)
        assert changed == [] and torch.equal(got[0][1], bucket(2, rows=400)[0][1])
        slot, path, layout = ring.write(in_transit(pack_bucket(bucket(3)), "b.bias"))
        assert reader.read(slot, path, layout)[1] == ["b.bias"]
    finally:
        ring.close()


def test_slots_of_a_dead_process_are_swept_and_room_is_checked():
    dead = shm.SHM_DIR / "xray-sync-999999999-x-0-1"  # beyond any pid this kernel hands out
    dead.write_bytes(b"0")
    mine = shm.SHM_DIR / f"xray-sync-{os.getpid()}-keep-0-1"
    mine.write_bytes(b"0")
    try:
        shm.SendRing("t").close()
        assert not dead.exists() and mine.exists()
    finally:
        dead.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)
    assert shm.usable(1 << 20) and not shm.usable(1 << 50)
