"""The `reward` section of a run config: where a response's score comes from (`xray/rewards/`
reads it). Held by `RunConfig` in `xray.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from xray.config.typed import ConfigError


@dataclass(frozen=True)
class RewardConfig:
    """Where the score of a response comes from: Python functions or a reward model."""

    function: Optional[str] = "xray.rewards.builtin:exact_answer"
    """`module:function` following TRL's reward-function convention; null when `model` or
    `functions` is set."""
    functions: list[str] = field(default_factory=list)
    """Several `module:function` rewards (TRL's `reward_funcs`), combined per sample as TRL does:
    the weighted sum of their scores, a None (no score) counting as nothing; each one's mean is
    logged as `reward/<name>`. Set `function: null` beside it. Empty: the one `function`."""
    weights: Optional[list[float]] = None
    """One weight per reward function (TRL's `reward_weights`), in the order of `functions` (or
    `[w]` for `function`); null: every weight 1."""
    workers: int = 0
    """Worker processes that call the synchronous reward functions, each on a contiguous chunk of
    the batch (CPU-heavy verifiers); the functions must be importable by name in a fresh process
    (`module:function` or `path/file.py:function`). 0: one thread of the caller's process.
    `xray.rewards.math_answer:math_verify` runs in its own pool either way."""
    model: Optional[str] = None
    """A Hugging Face sequence-classification directory run by the `reward` WholeModel."""
    scale: float = 1.0
    """Multiply scores by this."""
    clip: Optional[float] = None
    """Clip scores to [-clip, clip] after scaling (null: no clipping)."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """What a NaN or infinite score does (with several functions: a sample none of them scored):
    stop the run, or drop that sample."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response longer than rollout.max_new_tokens less this many
    tokens loses up to `overlong_penalty`, linearly, at the limit (added after scale and clip). 0: off."""
    overlong_penalty: float = 1.0
    """The overlong punishment at the length limit."""

    def __post_init__(self) -> None:
        if self.function and self.functions:
            raise ConfigError(f"reward: both function ({self.function}) and functions are set; set "
                              "reward.function=null to use the list (add it to reward.functions to keep it)")
        if len(set(self.functions)) != len(self.functions):
            raise ConfigError(f"reward.functions {self.functions} names a function twice; give it a larger "
                              "weight in reward.weights instead")
        n = len(self.specs)
        if self.weights is not None and len(self.weights) != n:
            raise ConfigError(f"reward.weights has {len(self.weights)} weights for {n} reward functions; give "
                              "one weight per entry of reward.functions (or null for weights of 1)")
        if self.workers < 0:
            raise ConfigError(f"reward.workers={self.workers}; give 0 (a thread) or a number of processes")

    @property
    def specs(self) -> tuple[str, ...]:
        """The reward functions' `module:function` names: `functions`, else `function`, else none."""
        return tuple(self.functions) or ((self.function,) if self.function else ())
