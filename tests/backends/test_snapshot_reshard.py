"""A snapshot held in memory restores into another layout exactly as its checkpoint on disk does.

The elastic resize and the node-loss recovery (`xray/run/recovery/elastic.py`, `recovery.py`) restore
the in-memory snapshot of the last step into a new layout without reading the disk. For each
engine, spawn A (2 ranks: Megatron tp=2, DeepSpeed ZeRO-3 dp=2) trains two steps, takes a snapshot
(`engine.snapshot`) and writes it; the test moves the written directory away, so that only memory
holds the snapshot under its own name. Spawn B (1 rank) loads it from every rank's held files
(`complete`: resharded from memory), spawn C (1 rank) from the moved directory on disk. B's and C's
log-probs on a fixed batch agree within 1e-6, so do their step counts; and B, built with twice the
learning rate (an elastic run's scaled lr), keeps its own peak lr at the restored schedule
position instead of the snapshot's: the schedule is a cosine decay to an absolute `min_lr` after a
one-step warm-up, restored one third of the way down.
"""
from __future__ import annotations

import math
import shutil

import pytest

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

LR, WARMUP, DECAY, MIN_LR = 1e-3, 1, 4, 1e-4
TOL = 1e-6


def _batch(seed: int):
    return R.random_batch(4, 12, TinySpec().vocab_size, seed=seed)


def _engine(backend: str, model_dir: str, world: int, lr: float):
    from xray.backends import load_backend

    optim = OptimConfig(lr=lr, warmup_steps=WARMUP, lr_schedule="cosine", min_lr=MIN_LR, decay_steps=DECAY)
    if backend == "megatron":
        return load_backend(backend).build_engine(model_dir, ParallelDims(tp=world), "actor", optim, seed=0)
    return load_backend(backend).build_engine(model_dir, ParallelDims(dp=world), "actor", optim, seed=0,
                                              zero_stage=3)


def _steps(engine) -> int:
    return engine.step if hasattr(engine, "step") and isinstance(engine.step, int) else engine.step_count


def _snapshot(rank, world, backend, model_dir, ckpt):
    engine = _engine(backend, model_dir, world, LR)
    for seed in (1, 2):
        batch = _batch(seed) if backend == "megatron" else _batch(seed).split(world)[rank]
        engine.train_step(batch, R.policy_loss, 2)
    snapshot = engine.snapshot(ckpt)
    snapshot()  # written too: the disk's copy, for the comparison
    return _bytes(snapshot.held())  # as bytes: a tensor sent back as itself dies with its process


def _bytes(value) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _value(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _load(rank, world, backend, model_dir, ckpt, held, lr):
    engine = _engine(backend, model_dir, world, lr)
    engine.load(ckpt, held and _value(held), complete=held is not None)
    out = engine.forward(_batch(0))
    return out[C.LOGPROBS].numpy(), _steps(engine), engine.scheduler.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("backend", ["megatron", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_a_snapshot_in_memory_restores_into_another_layout_as_its_checkpoint_does(tmp_path, backend):
    model_dir = str(build_tiny_model(tmp_path / "model", TinySpec(), seed=0))
    ckpt, moved = tmp_path / "ckpt", tmp_path / "on_disk"
    held = {k: v for data in run_distributed(_snapshot, 2, backend, model_dir, str(ckpt)) for k, v in _value(data).items()}
    shutil.move(str(ckpt), str(moved))  # memory alone holds the snapshot under its name now
    ((memory, memory_steps, memory_lr),) = run_distributed(_load, 1, backend, model_dir, str(ckpt), _bytes(held), 2 * LR)
    ((disk, disk_steps, disk_lr),) = run_distributed(_load, 1, backend, model_dir, str(moved), None, LR)
    assert not ckpt.exists()
    assert float(abs(memory - disk).max()) <= TOL
    assert memory_steps == disk_steps == 2
    shape = 0.5 * (1 + math.cos(math.pi * (2 - WARMUP) / (DECAY - WARMUP)))  # after two steps, restored: 0.75
    assert disk_lr == pytest.approx(MIN_LR + (LR - MIN_LR) * shape, rel=1e-12)
    assert memory_lr == pytest.approx(MIN_LR + (2 * LR - MIN_LR) * shape, rel=1e-12)  # its own peak, not the snapshot's
