"""Each weight-sync transport's two ends in their real forms, on the CPU, without Ray
(`xray/transport`): the sender's pack and the receiver's check, every tensor arriving bit for bit
with its checksum in the family its transport names, and a sender naming another family caught by
the receiver with both families in the message. The object store's wire form goes through pickle
with out-of-band buffers (as Ray moves it), the shared-memory slots through /dev/shm, the CUDA IPC
layout through a CPU buffer ("pw64", the device form, computed on the CPU), and the process group
through a real gloo group of two ranks (two threads), in both families. The same pg path with CUDA
tensors is the GPU tier's (tests/gpu/test_gpu_transports.py)."""
from __future__ import annotations

import pickle
import queue
import threading

import pytest
import torch

from xray.transport import faults, ipc, pg, shm, wire
from xray.transport.rendezvous import open_point
from xray.transport.errors import WeightSyncError
from xray.transport.wire import PW64, XXH3, changed_in_transit, pack_bucket, unpack_bucket

pytestmark = pytest.mark.unit


def bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(33, 70, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c.ids", torch.arange(11, dtype=torch.int64)), ("d.half", torch.randn(2, 3, generator=g).half())]


def assert_arrived(sent, got) -> None:
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (_, a), (_, b) in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def families(layout) -> set[str]:
    return {entry[-1][0] for entry in layout}


def through_object_store(wire_form):
    """The wire form as Ray moves it: pickled with its byte arrays out of band (protocol 5)."""
    buffers = []
    data = pickle.dumps(wire_form, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(wire_form)  # every tensor's bytes out of band, none pickled
    return pickle.loads(data, buffers=[b.raw() for b in buffers])


def over_gloo(device: str, send, receive, timeout_s: float = 30.0):
    """Rank 0 runs `send(group) -> (layout, size)` and rank 1 `receive(group, layout, size)` in a
    real gloo group of 2 (two threads of this process, `pg.join`, at a point this process opened
    as the sender's would); the receiver's answer, or the exception either rank raised."""
    (_, port), ahead, answers = open_point("127.0.0.1"), queue.Queue(), queue.Queue()

    def rank(r: int) -> None:
        try:
            group = pg.join("127.0.0.1", port, r, 2, device if device == "cuda" else "cpu", timeout_s)
            if r == 0:
                flat, layout = send(group)
                ahead.put((layout, flat.numel()))  # the layout goes ahead of the bytes (a Ray call in a run)
                pg.send(group, flat)
            else:
                layout, size = ahead.get(timeout=timeout_s)
                answers.put(receive(group, layout, size))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            answers.put(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    answer = answers.get(timeout=1.0)
    if isinstance(answer, BaseException):
        raise answer
    return answer


def test_object_store_ends_name_xxh3_and_catch_a_family_mismatch():
    sent = bucket()
    form = pack_bucket(sent)
    assert families(form) == {XXH3}
    arrived = through_object_store(form)
    assert changed_in_transit(arrived) == []
    assert_arrived(sent, unpack_bucket(arrived))
    relabelled = through_object_store(faults.in_transit(form, "family:pw64"))
    with pytest.raises(WeightSyncError, match="a.weight: checksum family mismatch: the sender named 'pw64', this "
                                              "receiver's transport checks 'xxh3' on bytes in host memory"):
        changed_in_transit(relabelled)


@pytest.mark.skipif(not shm.SHM_DIR.is_dir(), reason="no /dev/shm")
def test_shared_memory_ends_name_xxh3_and_catch_a_family_mismatch():
    sent = bucket()
    ring, reader = shm.SendRing("ends"), shm.SlotReader()
    try:
        slot, path, layout = ring.write(pack_bucket(sent))
        assert families(layout) == {shm.FAMILY} == {XXH3}
        got, changed = reader.read(slot, path, layout)
        assert changed == []
        assert_arrived(sent, got)
        slot, path, layout = ring.write(faults.in_transit(pack_bucket(sent), "family:pw64"))
        with pytest.raises(WeightSyncError, match="named 'pw64', this receiver's transport checks 'xxh3'"):
            reader.read(slot, path, layout)
    finally:
        ring.close()


def test_ipc_ends_name_pw64_computed_where_the_buffer_lies(monkeypatch):
    sent = bucket()
    buffer = torch.zeros(ipc.layout_size(sent), dtype=torch.uint8)
    layout = ipc.pack_into(buffer, sent)
    assert families(layout) == {ipc.FAMILY} == {PW64}
    monkeypatch.setattr(wire, "xxh3", lambda data: pytest.fail("the device form hashed on the host"))
    got, changed = ipc.views(buffer, layout)
    assert changed == [] and got[0][1].data_ptr() == buffer.data_ptr()  # views, no copy
    assert_arrived(sent, got)
    monkeypatch.undo()
    with pytest.raises(WeightSyncError, match="named 'xxh3', this receiver's transport checks 'pw64'"):
        ipc.views(buffer, ipc.pack_into(buffer, sent, corrupt="family:xxh3"))


@pytest.mark.parametrize("family", [None, PW64], ids=["gloo-xxh3", "device-form-pw64"])
def test_pg_ends_over_a_real_gloo_group(family, monkeypatch):
    """The group's two halves as a run calls them: `pack` + `send` on rank 0, `receive` on rank 1.
    None: the CPU group's own family ("xxh3"); "pw64": the NCCL family, computed on CPU tensors."""
    sent = bucket()
    layouts = []

    def send(group):
        flat, layout = pg.pack(sent, "cpu", family=family)
        layouts.append(layout)
        return flat, layout

    if family == PW64:  # the device form never hashes on the host
        monkeypatch.setattr(wire, "xxh3", lambda data: pytest.fail("the device form hashed on the host"))
    got, changed = over_gloo("cpu", send, lambda group, layout, size: pg.receive(group, layout, size, "cpu", family))
    assert families(layouts[0]) == {family or XXH3} and changed == []
    assert_arrived(sent, got)


def test_pg_ends_that_name_different_families_fail_naming_both():
    sent = bucket()
    # a sender on a GPU names "pw64"; a receiver whose copy is in host memory checks "xxh3"
    with pytest.raises(WeightSyncError, match="checksum family mismatch: the sender named 'pw64', this receiver's "
                                              "transport checks 'xxh3' on bytes in cpu.*family_for"):
        over_gloo("cpu", lambda group: pg.pack(sent, "cpu", family=PW64),
                  lambda group, layout, size: pg.receive(group, layout, size, "cpu"))

    def naming(family):
        def sender(group):
            flat, layout = pg.pack(sent, "cpu")  # "xxh3" values ...
            return flat, faults.in_buffer(flat, layout, f"family:{family}")  # ... named `family`
        return sender

    # the bug of main 59c3a67: the sender hashed host bytes ("xxh3") and the device receiver computed
    # "pw64"; named now, the receiver sees that the value is the other family's
    with pytest.raises(WeightSyncError, match="a.weight: checksum family mismatch: the sender named 'pw64' but sent "
                                              "the 'xxh3' checksum of these bytes"):
        over_gloo("cpu", naming(PW64), lambda group, layout, size: pg.receive(group, layout, size, "cpu", PW64))
    with pytest.raises(WeightSyncError, match="family 'crc32', unknown to this receiver.*same xray version"):
        over_gloo("cpu", naming("crc32"), lambda group, layout, size: pg.receive(group, layout, size, "cpu"))
