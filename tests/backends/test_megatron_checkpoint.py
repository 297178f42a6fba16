"""Megatron engine save / load: a fresh engine in fresh processes resumes bitwise.

Run A trains K steps, saves, then trains two more; run B (new processes) builds a fresh engine,
loads A's checkpoint and trains the same two steps: both losses must be bitwise equal (the second
one also checks the AdamW state and the warm-up schedule came back). A flash checkpoint
(`snapshot`) is written only after the two further steps: what lands on disk is still step K's.
A snapshot's files held in memory (`Snapshot.held`) restore the same, with the disk's files spoiled.
A Qwen3-MoE with its experts split over the two ranks (dp=2, ep=2) saves and resumes the same,
each rank's file holding its own experts.
"""
from __future__ import annotations

import pytest

from tests.dist_harness import as_bytes, from_bytes, run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

DIMS = (2, 1, 1)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=3)  # large steps and a live warm-up: resuming matters
K = 2


def _batch(step: int):
    return R.random_batch(4, 16, TinySpec().vocab_size, seed=100 + step)


def _train(engine, steps):
    return [engine.train_step(_batch(s), R.policy_loss, 2) for s in steps]


def _run_a(rank, world_size, model_dir, ckpt_dir, flash, dims):
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(*dims), "actor", OPTIM, seed=0)
    _train(engine, range(K))
    if not flash:
        engine.save(ckpt_dir)
        return _train(engine, range(K, K + 2))
    persist = engine.snapshot(ckpt_dir)
    after = _train(engine, range(K, K + 2))
    persist()  # the write lags the training: it must hold the snapshot's instant
    return after, as_bytes(persist.held())


def _run_b(rank, world_size, model_dir, ckpt_dir, held, dims):
    from xray.backends.megatron import build_engine

    engine = build_engine(model_dir, ParallelDims(*dims), "actor", OPTIM, seed=0)
    engine.load(ckpt_dir, {**from_bytes(held[0]), **from_bytes(held[rank])} if held else None)  # as the Workhorse
    return engine.step, _train(engine, range(K, K + 2))


@pytest.mark.parametrize("flash,arch", [(False, "llama"), (True, "llama"), ("held", "llama"), (False, "qwen3_moe")],
                         ids=["save", "flash", "held", "save-moe-ep2"])
def test_resume_is_bitwise(tmp_path, flash, arch):
    model_dir = str(build_tiny_model(tmp_path / "model", TinySpec(arch=arch), seed=0))
    ckpt = str(tmp_path / "ckpt")
    dims = (1, 1, 2, 2) if arch == "qwen3_moe" else DIMS
    a = run_distributed(_run_a, 2, model_dir, ckpt, bool(flash), dims)
    held = None
    if flash == "held":
        held = [files for _, files in a]
        for path in (tmp_path / "ckpt").iterdir():
            path.write_bytes(b"spoiled")  # only the held copy can restore now
    a = [r[0] if flash else r for r in a]
    b = run_distributed(_run_b, 2, model_dir, ckpt, held, dims)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank00000.pt", "rank00001.pt"]
    for rank in range(2):
        step, resumed = b[rank]
        assert step == K
        assert [m["loss"] for m in resumed] == [m["loss"] for m in a[rank]]
        assert [m["lr"] for m in resumed] == [m["lr"] for m in a[rank]] == [OPTIM.lr, OPTIM.lr]
    assert a[0][0]["loss"] != a[0][1]["loss"]  # the steps do change the model
