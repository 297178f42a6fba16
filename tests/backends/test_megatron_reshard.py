"""A Megatron checkpoint restores into another layout: saved at tp=2, loaded at tp=1.

Spawn A (tp=2) trains two steps, computes log-probs on a fixed batch and saves; spawn B (one
process, tp=1) loads the checkpoint (resharded: weights and AdamW moments) and must give the same
log-probs (max abs diff <= 1e-5) and step count, and the step after its next one must match A's
(so the AdamW moments and the schedule came back too).
"""
from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

OPTIM = OptimConfig(lr=1e-3, warmup_steps=3)
TOL = 1e-5


def _batch(seed: int):
    return R.random_batch(4, 16, TinySpec().vocab_size, seed=seed)


def _engine(model_dir: str, tp: int):
    from xray.backends.megatron import build_engine

    return build_engine(model_dir, ParallelDims(tp=tp), "actor", OPTIM, seed=0)


def _a(rank, world, model_dir, ckpt):
    engine = _engine(model_dir, world)
    for seed in (1, 2):
        engine.train_step(_batch(seed), R.policy_loss, 2)
    out = engine.forward(_batch(0))
    engine.save(ckpt)
    engine.train_step(_batch(3), R.policy_loss, 2)  # its update uses the AdamW moments and the schedule
    after = engine.train_step(_batch(4), R.policy_loss, 2)  # whose loss shows that update
    return (out[C.LOGPROBS].numpy() if out is not None else None), after["loss"]


def _b(rank, world, model_dir, ckpt):
    engine = _engine(model_dir, world)
    engine.load(ckpt)
    logprobs, step = engine.forward(_batch(0))[C.LOGPROBS].numpy(), engine.step
    engine.train_step(_batch(3), R.policy_loss, 2)
    return logprobs, step, engine.train_step(_batch(4), R.policy_loss, 2)["loss"]


def test_tp2_checkpoint_restores_at_tp1(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "model", TinySpec(), seed=0))
    ckpt = str(tmp_path / "ckpt")
    (before, next_loss), _ = run_distributed(_a, 2, model_dir, ckpt)
    ((logprobs, step, loss),) = run_distributed(_b, 1, model_dir, ckpt)
    assert float(abs(logprobs - before).max()) <= TOL
    assert step == 2
    assert loss == pytest.approx(next_loss, rel=1e-4)  # the moments and the schedule came back too
