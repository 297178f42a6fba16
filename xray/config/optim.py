"""The optimizer section of a trainable role: AdamW, its warm-up and its learning-rate decay,
shared by every backend (the schedule itself: `xray/backends/lr_schedule.py`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional

SCHEDULES = ("constant", "cosine", "linear")
"""The values of `optim.lr_schedule`."""


class OptimConfigError(ValueError):
    """An optimizer setting that cannot be used; the message says the fix."""


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
    """Linear warm-up over this many optimizer steps: optimizer step k (from 0) runs at
    lr x (k + 1) / warmup_steps; then `lr_schedule`."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After the warm-up: `constant` (stay at `lr`), or decay from `lr` to `min_lr` along half a
    cosine (`cosine`) or a straight line (`linear`), reaching `min_lr` at optimizer step
    `decay_steps` and staying there (Hugging Face's `get_cosine_with_min_lr_schedule_with_warmup`
    and `get_linear_schedule_with_warmup` after the warm-up, Megatron's `min_lr`)."""
    min_lr: float = 0.0
    """The learning rate a `cosine` or `linear` decay ends at (at most `lr`)."""
    decay_steps: Optional[int] = None
    """Optimizer steps from the start of training, warm-up included, to the end of the decay (more
    than `warmup_steps`). Null: the run's total optimizer steps, which the run computes (PPO and
    the critic-free algorithms: trainer.steps x ppo_epochs x the mini-batches of a step's samples;
    sft, pt and distill: sft.steps; rm: rm.steps). An engine built directly with a decaying
    schedule needs it set."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in SCHEDULES:
            raise OptimConfigError(f"optim.lr_schedule={self.lr_schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.min_lr < 0:
            raise OptimConfigError(f"optim.min_lr={self.min_lr} is negative; give 0 or a positive learning rate")
        if self.lr_schedule != "constant" and self.min_lr > self.lr:
            raise OptimConfigError(f"optim.min_lr={self.min_lr} is above the peak lr {self.lr}: the {self.lr_schedule} "
                                   "decay goes from lr down to min_lr; lower min_lr (sft and rm replace lr with "
                                   "sft.lr / rm.lr)")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise OptimConfigError(f"optim.decay_steps={self.decay_steps} does not exceed optim.warmup_steps="
                                   f"{self.warmup_steps}: the decay starts after the warm-up; give more decay "
                                   "steps (or null: the run's total optimizer steps)")

    def for_run(self, total_steps: int) -> "OptimConfig":
        """These settings for a run of `total_steps` optimizer steps: `decay_steps` becomes
        `total_steps` where it is unset and the schedule decays (a set one stays)."""
        if self.decay_steps is not None or self.lr_schedule == "constant":
            return self
        if total_steps <= self.warmup_steps:
            raise OptimConfigError(
                f"optim.lr_schedule={self.lr_schedule} decays over the run's {total_steps} optimizer steps, but "
                f"optim.warmup_steps={self.warmup_steps} takes them all; lower warmup_steps, train longer, or set "
                "optim.decay_steps")
        return replace(self, decay_steps=total_steps)
