"""A lost rank restores from its data-parallel peer's snapshot: Megatron's replicas hold one state.

`FlashCheckpoints` copies no Megatron snapshot to another node when every rank's data-parallel peer
sits on another node (`xray/run/snapshot_holder.py`, `peers_elsewhere`): a rank lost with its node
is restored from a live peer's file (`TrainEngine.as_rank`, `TrainWorkhorse.load(peers=)`). Spawn A
(dp=2) trains two steps, each rank on its own half of each batch, and takes a snapshot; spawn B
(dp=2) restores rank 0 from its own file and rank 1 from rank 0's. Rank 1's weights and AdamW
moments after the restore equal those of its own snapshot bit for bit, and a step trained after
it leaves both ranks equal. Without `as_rank`, rank 1 finds no file of its own among rank 0's
(`FileNotFoundError`): a rank reads its own path only.
"""
from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends


def _engine(model_dir: str):
    from xray.backends import load_backend

    return load_backend("megatron").build_engine(model_dir, ParallelDims(dp=2), "actor", OptimConfig(lr=1e-3), seed=0)


def _half(seed: int, rank: int):
    return R.random_batch(8, 12, TinySpec().vocab_size, seed=seed).split(2)[rank]


def _tensors(state) -> dict:
    """Every tensor of a Megatron file's model and optimizer state, by its place, as numpy."""
    import torch

    out = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = v.numpy().copy()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
    walk("model", state["model"])
    walk("optimizer", state["optimizer"])
    return out


def _snapshot(rank, world, model_dir, ckpt):
    from xray.backends.snapshot import to_wire

    engine = _engine(model_dir)
    for seed in (1, 2):
        engine.train_step(_half(seed, rank), R.policy_loss, 2)
    return to_wire(engine.snapshot(ckpt).held())


def _restore(rank, world, model_dir, ckpt, rank0_files):
    from xray.backends.snapshot import from_wire

    engine = _engine(model_dir)
    files = from_wire(rank0_files)
    engine.load(ckpt, files if rank == 0 else engine.as_rank(files, ckpt, 0, 1))
    restored = [v for v in engine.snapshot(ckpt).held().values()][0]
    engine.train_step(_half(3, rank), R.policy_loss, 2)
    after = [v for v in engine.snapshot(ckpt).held().values()][0]
    return _tensors(restored), _tensors(after), engine.step


def _refused(rank, world, model_dir, ckpt, rank0_files):
    from xray.backends.snapshot import from_wire

    engine = _engine(model_dir)
    if rank == 0:  # its own file: loads (and waits in load's barrier for a rank that will not come)
        return rank, None
    try:
        engine.load(ckpt, from_wire(rank0_files))  # rank 1 reads its own path, which the files lack
    except FileNotFoundError as exc:
        return rank, str(exc)
    return rank, "loaded"


def test_a_rank_restores_from_its_data_parallel_peers_snapshot_bit_for_bit(tmp_path):
    from xray.backends.snapshot import from_wire

    model_dir = str(build_tiny_model(tmp_path / "model", TinySpec(), seed=0))
    ckpt = str(tmp_path / "ckpt")
    taken = run_distributed(_snapshot, 2, model_dir, ckpt)
    own = [_tensors(next(iter(from_wire(files).values()))) for files in taken]
    assert own[0].keys() == own[1].keys() and len(own[1]) > 20
    assert any(k.startswith("optimizer/") for k in own[1])
    (restored0, after0, step0), (restored1, after1, step1) = run_distributed(_restore, 2, model_dir, ckpt, taken[0])
    for name, want in own[1].items():  # rank 1, restored from rank 0's file, holds its own snapshot's state
        assert (restored1[name] == want).all(), name
    assert step0 == step1 == 3
    for name, value in after0.items():  # and trains on with its peer in lockstep
        assert (after1[name] == value).all(), name
    assert any(not (after1[k] == own[1][k]).all() for k in own[1] if k.startswith("model/"))
    refusals = dict(run_distributed(_refused, 2, model_dir, ckpt, taken[0]))
    assert "not found" in refusals[1], refusals
