"""The CUDA IPC transport's buffer layout (`xray/transport/ipc.py`) on the CPU, and the transport
choice (`choose_transport` in xray/workhorse/train.py). The handles themselves need a GPU: the
GPU tier's end-to-end runs (tests/gpu) sync through them."""
from __future__ import annotations

import pytest
import torch

from xray.transport import ipc, wire
from xray.workhorse.train import choose_transport


def _bucket():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=g)),
            ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.ids", torch.arange(11, dtype=torch.int64)),
            ("d.half", torch.randn(2, 3, generator=g).half())]


def test_pack_into_then_views_round_trips_bit_for_bit_at_aligned_offsets():
    bucket = _bucket()
    buffer = torch.zeros(ipc.layout_size(bucket), dtype=torch.uint8)
    layout = ipc.pack_into(buffer, bucket)
    assert [entry[3] % wire.ALIGN for entry in layout] == [0, 0, 0, 0]
    assert {entry[5][0] for entry in layout} == {"pw64"}  # the family it names: computed where the buffer lies
    assert [entry[3] for entry in layout] == [0, 256, 512, 768]  # 60, 14, 88 bytes, each rounded up to 256
    got, changed = ipc.views(buffer, layout)
    assert changed == []
    for (name, sent), (got_name, held) in zip(bucket, got):
        assert got_name == name and held.dtype == sent.dtype and held.shape == sent.shape
        assert torch.equal(held.view(torch.uint8), sent.view(torch.uint8))
    assert got[0][1].data_ptr() == buffer.data_ptr()  # a view of the buffer, not a copy


def test_a_tensor_changed_after_its_checksum_is_caught():
    bucket = _bucket()
    buffer = torch.zeros(ipc.layout_size(bucket), dtype=torch.uint8)
    layout = ipc.pack_into(buffer, bucket, corrupt="b.bias")
    _, changed = ipc.views(buffer, layout)
    assert changed == ["b.bias"]
    buffer[layout[2][3]] ^= 1  # one bit of c.ids flipped in the buffer
    assert ipc.views(buffer, layout)[1] == ["b.bias", "c.ids"]


@pytest.mark.parametrize("gpu,same_node,same_gpu,shm_room,chosen", [
    (False, True, [False, False], True, "shm"),
    (False, True, [False], False, "objstore"),
    (False, False, [False], True, "pg"),
    (True, True, [True, True], True, "ipc"),        # the rollout on the actor's own GPU (ppo_gpu_1x)
    (True, True, [True, False], True, "objstore"),  # NCCL cannot group two processes of one GPU
    (True, True, [False, False], True, "pg"),
    (True, False, [False], True, "pg"),
])
def test_auto_picks_the_transport_the_placement_allows(gpu, same_node, same_gpu, shm_room, chosen):
    assert choose_transport("auto", gpu, same_node, same_gpu, lambda: shm_room) == chosen


@pytest.mark.parametrize("transport,gpu,same_node,same_gpu,fix", [
    ("shm", True, True, [False], "the CPU"),
    ("shm", False, False, [False], "the actor's node"),
    ("ipc", False, True, [False], "the actor's own GPU"),
    ("ipc", True, True, [True, False], "the actor's own GPU"),
    ("pg", True, True, [False, True], "Duplicate GPU"),
])
def test_an_explicit_transport_the_placement_cannot_take_says_the_fix(transport, gpu, same_node, same_gpu, fix):
    with pytest.raises(ValueError, match=fix):
        choose_transport(transport, gpu, same_node, same_gpu, lambda: True)
    assert choose_transport("objstore", gpu, same_node, same_gpu, lambda: True) == "objstore"
