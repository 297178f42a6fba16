"""The WholeModel runtime on a local Ray cluster: order, errors, deadlines, dead shards, async."""
import asyncio
import os
import signal
import time

import pytest
import torch

from xray.config.parallel import ParallelDims
from xray.data.batch import Batch
from xray.protocol import DispatchError
from xray.wholemodel import WholeModel
from xray.wholemodel.errors import CallDeadlineExceeded, WholeModelError, WorkhorseDied
from xray.workhorse.echo import EchoWorkhorse

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def echo4(local_ray):
    wm = WholeModel(EchoWorkhorse, role="echo", parallel=ParallelDims(dp=4), seed=7)
    yield wm
    wm.shutdown()


def test_shards_report_layout_and_distinct_seeds(echo4):
    assert [s.dp_rank for s in echo4.layout] == [0, 1, 2, 3]
    assert all(s.collects for s in echo4.layout)
    pings = echo4.ping().get()
    assert [p["rank"] for p in pings] == [0, 1, 2, 3]
    assert len({p["pid"] for p in pings}) == 4


def test_echo_returns_in_data_parallel_order(echo4):
    batch = Batch({"x": torch.arange(8) * 10}, {"tag": list("abcdefgh")})
    out = echo4.echo(batch).get()
    assert out["x"].tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    assert out["tag"] == list("abcdefgh")
    assert out["dp_rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_gloo_all_reduce_inside_the_model(echo4):
    results = echo4.all_reduce(1.0).get()
    assert [r["sum"] for r in results] == [10.0] * 4  # sum of (1 + rank) for ranks 0..3


def test_execute_first_and_awaitable(echo4):
    assert echo4.hello().get() == "echo rank 0"

    async def both():
        return await asyncio.gather(echo4.echo(Batch({"x": torch.arange(4)})), echo4.hello())

    out, hello = asyncio.run(both())
    assert out["x"].tolist() == [0, 1, 2, 3] and hello == "echo rank 0"


def test_uneven_slice_says_how_to_fix(echo4):
    with pytest.raises(DispatchError, match="pass a multiple of 4 rows"):
        echo4.echo(Batch({"x": torch.arange(6)}))


def test_failures_on_two_ranks_become_one_error(echo4):
    with pytest.raises(WholeModelError) as info:
        echo4.fail_on([1, 3]).get()
    err = info.value
    assert err.ranks == [1, 3]
    text = str(err)
    assert "failed on 2 of 4 shards (ranks [1, 3])" in text
    assert "ranks [1, 3]: ValueError: boom on purpose" in text
    assert "first traceback (rank 1)" in text and "fail_on" in text


def test_deadline_names_unfinished_ranks(echo4):
    t0 = time.perf_counter()
    with pytest.raises(CallDeadlineExceeded) as info:
        echo4.call("sleep", 4.0, [2], deadline_s=1.0).get()
    elapsed = time.perf_counter() - t0
    assert info.value.ranks == [2]
    assert elapsed < 1.0 + 2.0
    assert "unfinished shards: ranks [2]" in str(info.value)
    time.sleep(3.5)  # let rank 2 finish its sleep before the next test


def test_killed_workhorse_fails_fast_naming_its_rank(echo4):
    pids = [p["pid"] for p in echo4.ping().get()]
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkhorseDied) as info:
        echo4.noop().get()
    assert time.perf_counter() - t0 < 10.0
    assert info.value.ranks == [1]
    assert "Workhorse echo rank 1 died" in str(info.value)


def test_the_dead_are_found_without_waiting_for_the_busy(echo4):
    """`dead_models` (every recovery's first step): rank 3 killed while rank 2 is busy for 20 s: the
    dead rank is named once Ray reports it, the busy one counts as alive, and neither the busy call
    nor the 30 s allowed are waited for. (Rank 1 may be dead already, killed by the test above.)"""
    import ray
    from types import SimpleNamespace

    from xray.run.recovery.dead import dead_models

    shards = echo4.shard_handles()
    busy = shards[2].call.remote("sleep", ((20.0, [2]), {}))
    os.kill(ray.get(shards[3].pid.remote()), signal.SIGKILL)
    t0 = time.perf_counter()
    found = dead_models(SimpleNamespace(actor=echo4), wait_s=30.0)
    took = time.perf_counter() - t0
    assert set(found) == {"actor"} and set(found["actor"]) - {1} == {3}, found
    assert took < 10.0, f"dead_models took {took:.1f} s: it waited for the busy rank or for wait_s"
    assert echo4.dead_ranks() == found["actor"]  # the one-model call, rank 2 still busy
    ray.cancel(busy)
