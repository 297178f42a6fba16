"""The `reward` section of a run config: where a response's score comes from (`xray/rewards/`
reads it). Held by `RunConfig` in `xray.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class RewardConfig:
    """Where the score of a response comes from: a Python function or a reward model."""

    function: Optional[str] = "xray.rewards.builtin:exact_answer"
    """`module:function` following TRL's reward-function convention; null when `model` is set."""
    model: Optional[str] = None
    """A Hugging Face sequence-classification directory run by the `reward` WholeModel."""
    scale: float = 1.0
    """Multiply scores by this."""
    clip: Optional[float] = None
    """Clip scores to [-clip, clip] after scaling (null: no clipping)."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """What a NaN or infinite score does: stop the run, or drop that sample."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens less this many
    tokens loses up to `overlong_penalty`, linearly, at the limit (added after scale and clip). 0: off."""
    overlong_penalty: float = 1.0
    """The overlong punishment at the length limit."""
