"""The data plane: answers skip the WholeModel Ray actor, data moves by reference, deadlines cancel."""
import time

import pytest
import ray
import torch

from xray.config.parallel import ParallelDims
from xray.data.batch import Batch
from xray.data.wire import Ragged
from xray.wholemodel import WholeModel
from xray.wholemodel.errors import CallDeadlineExceeded
from xray.wholemodel.handle import INLINE_BYTES
from xray.workhorse.echo import EchoWorkhorse

pytestmark = pytest.mark.ray

@pytest.fixture(scope="module")
def echoes(local_ray):
    two = WholeModel(EchoWorkhorse, role="echo2", parallel=ParallelDims(dp=2))
    four = WholeModel(EchoWorkhorse, role="echo4", parallel=ParallelDims(dp=4))
    yield two, four
    two.shutdown()
    four.shutdown()

def _memory_of(pid: int) -> dict[str, int]:
    """Peak resident memory and bytes read through syscalls of a process on this machine."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    io = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines())
    return {"hwm_kb": int(status["VmHWM"].split()[0]), "rchar": int(io["rchar"])}

def test_a_64mb_answer_does_not_pass_through_the_wholemodel_actor(echoes):
    two, _ = echoes
    pid = ray.get(two._actor.pid.remote())
    before = _memory_of(pid)
    out = two.payload(32).get()  # 32 MiB from each of 2 replicas
    after = _memory_of(pid)
    assert out.nbytes() == 64 << 20
    assert out["x"][: 8 << 20].eq(0).all() and out["x"][8 << 20:].eq(1).all()
    # The old path deserialised and re-sent the answer in that process: +64 MiB at least.
    assert after["hwm_kb"] - before["hwm_kb"] < 4 << 10
    assert after["rchar"] - before["rchar"] < 1 << 20

def test_answers_pass_by_reference_across_data_parallel_sizes(echoes):
    two, four = echoes
    batch = Batch({"x": torch.arange(8) * 10}, {"ids": [[i] * (i % 3) for i in range(8)]})
    first = two.echo(batch)  # not fetched here
    again = four.echo(first)  # 2 parts re-split over 4 replicas on the Workhorses
    out = again.get()
    assert out["x"].tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    assert list(out["ids"]) == [[i] * (i % 3) for i in range(8)]
    assert out["dp_rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    back = two.echo(again).get()  # 4 parts joined into 2
    assert back["x"].tolist() == out["x"].tolist() and back["dp_rank"].tolist() == [0] * 4 + [1] * 4

def test_parts_of_different_widths_are_right_padded(echoes):
    two, _ = echoes
    wide = two.echo(Batch({"m": torch.ones(2, 3)})).get()
    assert wide["m"].shape == (2, 3)

    joined = Batch.concat([Batch({"m": torch.ones(1, 2)}), Batch({"m": torch.ones(1, 4)})], pad_width=True)
    assert joined["m"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]

def test_deadline_cancels_so_the_next_call_does_not_wait(echoes):
    two, _ = echoes
    with pytest.raises(CallDeadlineExceeded) as info:
        two.call("sleep", 30.0, [1], deadline_s=0.5).get()
    assert info.value.ranks == [1]
    t0 = time.perf_counter()
    assert two.noop().get() == [None, None]
    assert time.perf_counter() - t0 < 5.0  # without ray.cancel it waits out the 30 s sleep

def test_token_lists_arrive_ragged(echoes):
    two, _ = echoes
    out = two.echo(Batch({"x": torch.zeros(4)}, {"ids": [[1, 2], [], [3], [4, 5, 6]]})).get()
    assert isinstance(out["ids"], Ragged) and list(out["ids"]) == [[1, 2], [], [3], [4, 5, 6]]


def test_only_the_columns_a_method_reads_are_shipped(echoes):
    two, _ = echoes
    batch = Batch({"x": torch.zeros(4), "y": torch.ones(4)}, {"prompt_ids": [[1]] * 4})
    assert two.received(batch).get() == [["x"], ["x"]]
    assert two.received(two.echo(batch)).get() == [["x"], ["x"]]  # by reference too


def test_large_shared_arguments_are_stored_once_small_ones_travel_inline(echoes):
    """A part every shard takes goes into the object store once when large (`INLINE_BYTES`); a
    small part, and a slice that one shard alone takes, go inside the calls (no `ray.put`)."""
    two, _ = echoes
    many = list(range(100, 100 + INLINE_BYTES // 8))
    shared = two._dispatch(two.methods["fail_on"], (many,), {})
    assert isinstance(shared[0], ray.ObjectRef) and shared[0] is shared[1]
    assert two.fail_on(many).get() == [0, 1]  # no rank is in the list: it arrived whole
    assert two._dispatch(two.methods["fail_on"], ([0],), {}) == [(([0],), {})] * 2
    sliced = two._dispatch(two.methods["echo"], (Batch({"x": torch.zeros(2, INLINE_BYTES)}),), {})
    assert [type(p) for p in sliced] == [tuple, tuple]
    assert two.echo(Batch({"x": torch.arange(2 * INLINE_BYTES).view(2, -1)})).get()["x"][1, -1] == 2 * INLINE_BYTES - 1
