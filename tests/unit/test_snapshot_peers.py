"""Which snapshots need a copy on another node, and which peer's file restores a lost rank.

`FlashCheckpoints` makes no holder copy of a model whose data-parallel replicas' files are alike
(Megatron without expert parallelism: `Engine.replicas_identical`) when every rank has a peer on
another node (`peers_elsewhere`); `held_for` then names, for each rank whose node is gone, a
peer on a live node (`live_peer`), where a copy would have been read before. DeepSpeed's
replicas differ (ZeRO partitions), and a DeepSpeed rank without its copy gets no peer: it is read
from the disk. Of such a model only one rank per place hands its file out (`handers`, off the
driver's node); a lost keeper reads the hander's file, and when the hander's node is gone the
keeper hands its own (`materialize`), which then restores the hander's rank.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from xray.config.parallel import ParallelDims
from xray.run.snapshot_holder import dp_peers, handers, live_peer, peers_elsewhere

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


def test_one_rank_per_place_hands_its_file_out_off_the_drivers_node():
    p = ParallelDims(tp=2, dp=2)
    assert handers(p, ["head", "head", "worker", "worker"], "head") == [2, 3]
    assert handers(p, ["worker", "worker", "head", "head"], "head") == [0, 1]
    assert handers(p, ["a", "a", "b", "b"], "head") == [0, 1]  # the driver elsewhere: the first replica
    assert handers(ParallelDims(dp=3), ["head", "head", "w"], "head") == [2]
    assert live_peer(p, ["head", "head", "worker", "worker"], {"head", "worker"}, 0, usable={2, 3}) == 2
    assert live_peer(p, ["head", "head", "worker", "worker"], {"head"}, 0, usable={2, 3}) is None


def test_a_kept_file_is_read_from_the_hander_until_its_node_goes_then_from_its_keeper(tmp_path):
    """Rank 0 (driver's node) kept its file in its process, rank 1 handed its own. Rank 0's process
    lost: rank 1's file restores it. The worker node lost: no file can be read until `materialize`
    has the keeper hand its own, which then restores rank 1 too."""
    import asyncio

    from xray.run.checkpoints import FlashCheckpoints, Held
    from xray.run.outputs import RunDir

    asked = []

    async def hand_kept(key):
        asked.append(key)
        return {0: "kept0"}

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    checkpoints = FlashCheckpoints(run, models=SimpleNamespace(actor=SimpleNamespace(hand_kept=hand_kept)),
                                   roles=("actor",), keep_on_peers=True)
    d, parallel = run.checkpoint_dir(3), ParallelDims(dp=2)
    checkpoints._held[d] = Held(3, d, {"actor": (parallel, [None, "own1"])}, {"step": 3},
                                {"actor": (["head", "worker"], [None, None])}, frozenset({"actor"}),
                                {"actor": "actor:k"})
    alive = {"head", "worker"}
    checkpoints._replicas = SimpleNamespace(alive=lambda: set(alive))
    assert checkpoints.held_for(d, "actor") == {"held": [None, "own1"], "saved": parallel, "peers": {0: 1}}
    alive.discard("worker")
    assert checkpoints.held_for(d, "actor") == {"held": [None, "own1"], "saved": parallel}
    asyncio.run(checkpoints.materialize(d))
    assert asked == ["actor:k"]
    assert checkpoints.held_for(d, "actor") == {"held": ["kept0", "own1"], "saved": parallel, "peers": {1: 0}}
    asyncio.run(checkpoints.materialize(d))  # nothing kept is missing any more: no call
    assert asked == ["actor:k"]


def test_ranks_keep_their_files_only_when_a_peer_on_another_node_hands_its_own(tmp_path):
    from xray.run.checkpoints import FlashCheckpoints
    from xray.run.outputs import RunDir

    model = SimpleNamespace(parallel=ParallelDims(dp=2))
    checkpoints = FlashCheckpoints(RunDir(tmp_path / "run", loggers=("jsonl",)), models=None, roles=("actor",),
                                   keep_on_peers=True)
    checkpoints._replicas = SimpleNamespace(nodes={"actor": ["head", "worker"]}, driver="head")
    checkpoints._moved, checkpoints._peer_roles = False, frozenset({"actor"})
    assert checkpoints._handers("actor", model) == [1]
    checkpoints._replicas.nodes["actor"] = ["head", "head"]  # both replicas on one node: every rank hands
    assert checkpoints._handers("actor", model) is None
    checkpoints._replicas.nodes["actor"] = ["head", "worker"]
    checkpoints._moved = True  # the nodes are to be looked up again
    assert checkpoints._handers("actor", model) is None
    checkpoints._moved, checkpoints.keep_on_peers = False, False  # an asynchronous run's trainer
    assert checkpoints._handers("actor", model) is None
