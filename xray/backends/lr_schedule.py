"""The learning-rate schedule: one pure function of the optimizer step, for every training backend.

Sits under `xray/backends/optim.py`, which turns `lr_factor` into the torch scheduler that the
Megatron engine (plain and mixed precision), the DeepSpeed engine (its client scheduler), the
plain Hugging Face Workhorse and the single-process reference (`xray.check.reference`) all step
once per optimizer step; so every backend runs the same rate at every step. The settings are
`OptimConfig`'s (`xray/config/optim.py`): a linear warm-up, then constant, cosine or linear decay
to `min_lr` over `decay_steps`.
"""
from __future__ import annotations

import math

from xray.config.optim import OptimConfig


class ScheduleError(ValueError):
    """A decaying schedule without its horizon; the message says the fix."""


def decay_horizon(cfg: OptimConfig) -> int:
    """The optimizer step at which a decaying schedule reaches `min_lr` (`cfg.decay_steps`)."""
    if cfg.decay_steps is None:
        raise ScheduleError(
            f"optim.lr_schedule={cfg.lr_schedule} decays over optim.decay_steps optimizer steps, which is unset; a "
            "run sets it to its total optimizer steps (OptimConfig.for_run), an engine built directly needs "
            "OptimConfig(decay_steps=N)")
    return cfg.decay_steps


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr `cfg.lr` at optimizer step `step` (0-based: the k-th update runs at
    `cfg.lr * lr_factor(k, cfg)`). Warm-up: (step + 1) / warmup_steps, so the first update is not
    wasted at lr 0 and step warmup_steps - 1 runs at the peak. Then, with progress
    p = (step - warmup_steps) / (decay_steps - warmup_steps) capped at 1, the factor goes from 1
    to min_lr / lr as floor + (1 - floor) * shape(p), shape = (1 + cos(pi p)) / 2 (cosine) or 1 - p
    (linear): the peak at the first step after the warm-up, min_lr from step decay_steps on."""
    warmup = cfg.warmup_steps
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return 1.0
    horizon = decay_horizon(cfg)
    progress = min(1.0, max(0.0, (step - warmup) / (horizon - warmup)))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress
    floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    return floor + (1.0 - floor) * shape
