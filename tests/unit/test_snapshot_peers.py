"""Which snapshots need a copy on another node, and which peer's file restores a lost rank.

`FlashCheckpoints` makes no holder copy of a model whose data-parallel replicas' files are alike
(Megatron without expert parallelism: `Engine.replicas_identical`) when every rank has a peer on
another node (`peers_elsewhere`); `held_for` then names, for each rank whose node is gone, a
peer on a live node (`live_peer`), where a copy would have been read before. DeepSpeed's
replicas differ (ZeRO partitions), and a DeepSpeed rank without its copy gets no peer: it is read
from the disk.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from xray.config.parallel import ParallelDims
from xray.run.snapshot_holder import dp_peers, live_peer, peers_elsewhere

pytestmark = pytest.mark.unit


def test_the_peers_of_a_rank_share_its_tensor_and_pipeline_place():
    p = ParallelDims(tp=2, pp=1, dp=3)  # ranks: tp fastest, then dp
    assert dp_peers(p, 0) == [2, 4] and dp_peers(p, 3) == [1, 5]
    assert dp_peers(ParallelDims(dp=1), 0) == []


def test_peers_cover_a_snapshot_only_when_every_rank_has_one_on_another_node():
    p = ParallelDims(tp=2, dp=2)
    assert peers_elsewhere(p, ["a", "a", "b", "b"])  # replica 0 on a, replica 1 on b
    assert not peers_elsewhere(p, ["a", "b", "a", "b"])  # each tp rank's peer on its own node
    assert not peers_elsewhere(ParallelDims(dp=1), ["a"])
    assert not peers_elsewhere(ParallelDims(dp=2), ["a", "a"])
    assert live_peer(p, ["a", "a", "b", "b"], {"a"}, 2) == 0 and live_peer(p, ["a", "a", "b", "b"], {"a"}, 3) == 1
    assert live_peer(p, ["a", "a", "b", "b"], {"c"}, 2) is None


def test_the_engines_say_whose_replicas_are_alike():
    from xray.config.engines import engine
    from xray.run.checkpoints import replicas_identical

    assert engine("megatron").replicas_identical and not engine("deepspeed").replicas_identical
    model = SimpleNamespace(init_kwargs={"backend": "megatron"}, parallel=ParallelDims(dp=2))
    assert replicas_identical(model)
    assert not replicas_identical(SimpleNamespace(init_kwargs={"backend": "megatron"}, parallel=ParallelDims(dp=2, ep=2)))
    assert not replicas_identical(SimpleNamespace(init_kwargs={"backend": "deepspeed"}, parallel=ParallelDims(dp=2)))


def _checkpoints(tmp_path: Path, peers: frozenset[str]):
    from xray.run.checkpoints import FlashCheckpoints, Held
    from xray.run.outputs import RunDir

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    checkpoints = FlashCheckpoints(run, models=None, roles=("actor",))
    d = run.checkpoint_dir(3)
    parallel = ParallelDims(dp=2)
    checkpoints._held[d] = Held(3, d, {"actor": (parallel, ["own0", "own1"])}, {"step": 3},
                                {"actor": (["head", "worker"], [None, None])}, peers)
    checkpoints._replicas = SimpleNamespace(alive=lambda: {"head"})  # the worker node is gone
    return checkpoints, d, parallel


def test_a_rank_lost_with_its_node_is_read_from_a_live_peer_where_replicas_are_alike(tmp_path):
    checkpoints, d, parallel = _checkpoints(tmp_path, frozenset({"actor"}))
    assert checkpoints.held_for(d, "actor") == {"held": ["own0", "own1"], "saved": parallel, "peers": {1: 0}}
    checkpoints, d, parallel = _checkpoints(tmp_path, frozenset())  # DeepSpeed: no peer stands in
    assert checkpoints.held_for(d, "actor") == {"held": ["own0", "own1"], "saved": parallel}
