"""The optimizer section of a trainable role: AdamW and its warm-up, shared by every backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule settings shared by the training backends."""

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many optimizer steps, then constant."""
