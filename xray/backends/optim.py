"""Optimizer and learning-rate schedule shared by the training backends and the parity reference.

Both training backends and `xray.check.reference` build the same torch AdamW and the same linear
warm-up, so that a sharded step and the single-process reference step agree to rounding.
"""
from __future__ import annotations

from typing import Iterable

import torch

from xray.backends.base import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW (no fused or foreach kernels, so every layout runs the same arithmetic)."""
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False, fused=False)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_factor(s, cfg.warmup_steps))
