"""The GPU tier of the weight-sync transports (`xray/transport`), without Ray: the process-group
path with CUDA tensors and the CUDA IPC layout on a GPU buffer, each tensor checksummed in "pw64"
on the device by both ends, none hashed on the host, and a host-family ("xxh3") layout refused by
a device receiver naming both families.

NCCL cannot put two ranks on one GPU, so the group is gloo (which moves CUDA tensors) between two
threads of this process on the lent GPU: the same `pg.pack` / `pg.send` / `pg.receive` a run calls,
with the family of a CUDA buffer. Skipped without CUDA; `XRAY_GPU_TIER_DEVICE=cpu` runs the same
on the CPU (a check of the test, not of a GPU), as tests/gpu/test_gpu_tier.py does. The CPU forms
of both ends are tests/unit/test_sync_transports.py, whose helper this reuses.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.unit.test_sync_transports import assert_arrived, bucket, families, over_gloo
from xray.transport import faults, ipc, pg, wire
from xray.transport.errors import WeightSyncError
from xray.transport.wire import PW64

DEVICE = os.environ.get("XRAY_GPU_TIER_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or XRAY_GPU_TIER_DEVICE=cpu)")]


def on_device() -> list[tuple[str, torch.Tensor]]:
    return [(name, t.to(DEVICE)) for name, t in bucket()]


def test_pg_over_a_group_with_cuda_tensors_checks_pw64_on_the_device(monkeypatch):
    sent = on_device()
    monkeypatch.setattr(wire, "xxh3", lambda data: pytest.fail("a device's bytes were hashed on the host"))
    layouts = []

    def send(group):
        flat, layout = pg.pack(sent, DEVICE, family=PW64)
        assert flat.device.type == torch.device(DEVICE).type
        layouts.append(layout)
        return flat, layout

    def receive(group, layout, size):
        return pg.receive(group, layout, size, DEVICE, PW64)

    got, changed = over_gloo("cpu", send, receive)  # gloo between two threads: NCCL refuses one GPU twice
    assert families(layouts[0]) == {PW64} and changed == []
    assert all(t.device.type == torch.device(DEVICE).type for _, t in got)  # received on the device
    assert_arrived(sent, got)
    monkeypatch.undo()  # a mismatch looks for another family's checksum, on the host: failures only

    def send_rows_swapped(group):
        flat, layout = pg.pack(sent, DEVICE, family=PW64)
        return flat, faults.in_buffer(flat, layout, "rows:a.weight")

    assert over_gloo("cpu", send_rows_swapped, receive)[1] == ["a.weight"]  # two rows swapped, caught on the device


def test_ipc_layout_on_a_gpu_buffer_names_pw64_and_refuses_xxh3(monkeypatch):
    sent = on_device()
    buffer = torch.zeros(ipc.layout_size(sent), dtype=torch.uint8, device=DEVICE)
    monkeypatch.setattr(wire, "xxh3", lambda data: pytest.fail("a device's bytes were hashed on the host"))
    layout = ipc.pack_into(buffer, sent)
    got, changed = ipc.views(buffer, layout)
    assert families(layout) == {PW64} and changed == []
    assert_arrived(sent, got)
    monkeypatch.undo()
    with pytest.raises(WeightSyncError, match="the sender named 'xxh3', this receiver's transport checks 'pw64'"):
        ipc.views(buffer, ipc.pack_into(buffer, sent, corrupt="family:xxh3"))
