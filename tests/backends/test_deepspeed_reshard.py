"""A ZeRO-3 checkpoint restores into another data-parallel size: dp=2 -> dp=1 and back (both `slow`).

Spawn A (dp=2) trains two steps and saves; spawn B (dp=1) loads it, computes log-probs on a fixed
batch (equal to A's before saving, max abs diff <= 1e-5), trains one step and saves; in the slow
test, spawn C (dp=2) loads B's checkpoint and must give B's log-probs after its step, and B's
step count.
"""
from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check.reference import policy_loss, random_batch
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

OPT = OptimConfig(lr=1e-3, warmup_steps=0)
TOL = 1e-5


def _batch(seed: int):
    return random_batch(4, 12, TinySpec().vocab_size, seed=seed)


def _engine(model_dir: str, dp: int):
    from xray.backends.deepspeed import build_engine

    return build_engine(model_dir, ParallelDims(dp=dp), "actor", OPT, seed=0, zero_stage=3)


def _a(rank, world, model_dir, root):
    engine = _engine(model_dir, world)
    for seed in (1, 2):
        engine.train_step(_batch(seed).split(world)[rank], policy_loss, 2)
    logprobs = engine.forward(_batch(0))[C.LOGPROBS].numpy()  # ZeRO-3 gathers: every rank runs the whole batch
    engine.save(f"{root}/dp2")
    return logprobs


def _b(rank, world, model_dir, root):
    engine = _engine(model_dir, world)
    engine.load(f"{root}/dp2")
    loaded = engine.forward(_batch(0))[C.LOGPROBS].numpy()
    engine.train_step(_batch(3), policy_loss, 2)
    stepped = engine.forward(_batch(0))[C.LOGPROBS].numpy()
    engine.save(f"{root}/dp1")
    return loaded, stepped, engine.step_count


def _c(rank, world, model_dir, root):
    engine = _engine(model_dir, world)
    engine.load(f"{root}/dp1")
    return engine.forward(_batch(0))[C.LOGPROBS].numpy(), engine.step_count


def dp2_then_dp1(tmp_path) -> tuple[str, str, tuple]:
    model_dir = str(build_tiny_model(tmp_path / "model", TinySpec(), seed=0))
    root = str(tmp_path / "ckpt")
    before = run_distributed(_a, 2, model_dir, root)[0]
    ((loaded, stepped, steps),) = run_distributed(_b, 1, model_dir, root)
    assert float(abs(loaded - before).max()) <= TOL
    assert float(abs(stepped - loaded).max()) > 1e-4  # the dp=1 step moved the model
    return model_dir, root, (stepped, steps)


@pytest.mark.slow  # 1 min; the elastic test (slow too) also restores ZeRO-3 across dp
def test_zero3_dp2_checkpoint_restores_at_dp1(tmp_path):
    dp2_then_dp1(tmp_path)


@pytest.mark.slow
def test_zero3_checkpoint_goes_back_to_dp2(tmp_path):
    model_dir, root, (stepped, steps) = dp2_then_dp1(tmp_path)
    for logprobs, count in run_distributed(_c, 2, model_dir, root):
        assert float(abs(logprobs - stepped).max()) <= TOL
        assert count == steps == 3
