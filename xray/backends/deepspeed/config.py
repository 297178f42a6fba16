"""The DeepSpeed config dict the engine hands to `deepspeed.initialize`, built from typed options.

Sits inside the DeepSpeed training backend (`xray/backends/deepspeed/`). The optimizer and the
learning-rate schedule are NOT in this dict: the engine passes xray's own torch AdamW and linear
warm-up (`xray.backends.optim`) as DeepSpeed's client optimizer and client scheduler, so every
backend and the single-process reference run the same update arithmetic (DeepSpeed's `WarmupLR`
ramps differently). Gradient clipping is DeepSpeed's, which ZeRO needs to see the global norm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xray.backends.base import OptimConfig


class DeepSpeedConfigError(ValueError):
    """An engine option DeepSpeed cannot run; the message says the fix."""


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO settings beyond the stage; the defaults suit small models and exact parity."""

    reduce_bucket_size: int | None = None
    """Elements per gradient reduce bucket; None: hidden_size**2, what transformers' DeepSpeed
    integration picks for "auto" (DeepSpeed's own 5e8 makes stage 3 hold a 2 GB fp32 buffer)."""
    allgather_bucket_size: int | None = None
    """Elements per parameter all-gather bucket (stages 1 and 2); None: hidden_size**2."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward; off keeps reduction order fixed."""
    param_persistence_threshold: int = 0
    """Stage 3: parameters with fewer elements stay whole on every rank (DeepSpeed's default
    is 1e5); 0 shards every parameter, so memory scales as 1/dp even on tiny models."""
    prefetch_bucket_size: int | None = None
    """Stage 3: elements of parameters fetched ahead of their use; None: 0.9 * hidden_size**2."""
    dtype: str = "float32"
    """Parameter and compute dtype: `float32` (CPU, parity) or `bfloat16` (GPU; DeepSpeed keeps
    fp32 master weights in the optimizer)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise DeepSpeedConfigError(f"ZeroOptions.dtype={self.dtype!r}; use 'float32' or 'bfloat16'")


def deepspeed_config(zero_stage: int, optim: OptimConfig, dp_size: int, hidden_size: int,
                     options: ZeroOptions = ZeroOptions(), trains: bool = True) -> dict[str, Any]:
    """The config dict for `deepspeed.initialize`. The batch keys are placeholders (micro-batch 1,
    no accumulation): each `train_step` resets them to the batch it is given. `hidden_size` sizes
    the buckets the options leave as None. A model that does not train (the reference) has no
    optimizer state or gradients to shard: stages 1 and 2 become stage 0 (DeepSpeed refuses them
    without an optimizer), stage 3 still shards its parameters."""
    if zero_stage not in (1, 2, 3):
        raise DeepSpeedConfigError(f"zero_stage={zero_stage!r}; the DeepSpeed engine runs ZeRO stage 1, 2 or 3")
    zero: dict[str, Any] = {
        "stage": zero_stage if trains or zero_stage == 3 else 0,
        "overlap_comm": options.overlap_comm,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": options.reduce_bucket_size or hidden_size**2,
        "allgather_bucket_size": options.allgather_bucket_size or hidden_size**2,
    }
    if zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=options.param_persistence_threshold,
                    stage3_prefetch_bucket_size=options.prefetch_bucket_size or int(0.9 * hidden_size**2),
                    stage3_gather_16bit_weights_on_model_save=False)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dp_size,
        "gradient_clipping": float(optim.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": options.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
