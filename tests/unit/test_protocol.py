"""The fan-out protocol's pure functions on a tp=2, pp=2, dp=2 layout (8 shards), no Ray."""
import pytest
import torch

from xray import protocol
from xray.backends.base import layout_of
from xray.config.parallel import ParallelDims
from xray.data.batch import Batch
from xray.protocol import DispatchError, fanout

pytestmark = pytest.mark.unit
DIMS = ParallelDims(tp=2, pp=2, dp=2)
LAYOUT = [layout_of(DIMS, r) for r in range(8)]


def test_slice_gives_peers_the_same_part():
    batch = Batch({"x": torch.arange(6)}, {"t": list("abcdef")})
    per_shard = protocol.dispatch(LAYOUT, "slice", (batch, 0.5), {"ids": [[1], [2], [3], [4], [5], [6]]})
    got = [(a[0]["x"].tolist(), a[1], kw["ids"]) for a, kw in per_shard]
    first = ([0, 1, 2], 0.5, [[1], [2], [3]])
    second = ([3, 4, 5], 0.5, [[4], [5], [6]])
    # rank order: tp fastest, then dp, then pp -> dp_rank per rank is 0,0,1,1,0,0,1,1
    assert got == [first, first, second, second, first, first, second, second]
    assert protocol.part_of_shard(LAYOUT) == [0, 0, 1, 1, 0, 0, 1, 1]


def test_collectors_are_tp0_on_last_stage():
    assert protocol.collectors(LAYOUT) == [4, 6]
    assert [s.rank for s in LAYOUT if s.collects] == [4, 6]


def test_flatten_restores_input_order():
    batch = Batch({"x": torch.arange(10) * 3})
    per_shard = protocol.dispatch(LAYOUT, "slice", (batch,), {})
    results = [a[0] if s.collects else None for s, (a, _) in zip(LAYOUT, per_shard)]
    out = protocol.collect(LAYOUT, "flatten", results)
    assert out["x"].tolist() == (torch.arange(10) * 3).tolist()
    assert protocol.collect(LAYOUT, "none", list(range(8))) == [4, 6]
    assert protocol.concat([{"a": [1]}, {"a": [2, 3]}]) == {"a": [1, 2, 3]}


def test_uneven_slice_says_how_to_fix():
    with pytest.raises(DispatchError, match="5 rows.*over 2 data-parallel replicas; pass a multiple of 2"):
        protocol.dispatch(LAYOUT, "slice", (torch.zeros(5, 3),), {})


def test_all_and_callable_dispatch_and_collect():
    assert protocol.dispatch(LAYOUT, "all", (1,), {"k": 2}) == [((1,), {"k": 2})] * 8
    by_rank = protocol.dispatch(LAYOUT, lambda layout, a, kw: [((s.rank,), {}) for s in layout], (), {})
    assert [a[0] for a, _ in by_rank] == list(range(8))
    assert protocol.collect(LAYOUT, lambda layout, r: sum(r), list(range(8))) == 28
    with pytest.raises(DispatchError, match="returned 1 argument sets for 8 shards"):
        protocol.dispatch(LAYOUT, lambda layout, a, kw: [((), {})], (), {})


def test_decorator_only_attaches_metadata():
    class W:
        @fanout(dispatch="slice", collect="flatten", deadline_s=5)
        def f(self, x):
            return x + 1

    assert W().f(1) == 2
    meta = protocol.fanout_methods(W)["f"]
    assert (meta.dispatch, meta.execute, meta.collect, meta.deadline_s) == ("slice", "all", "flatten", 5)
    with pytest.raises(ValueError, match="execute must be"):
        fanout(execute="some")
