"""What a registered advantage estimator reads (`algorithms/core`, the shared RL math): one step's
scored samples as `[B]` and `[B, T-1]` tensors, plus the settings the estimators share.

Layout: `[B, T-1]` tensors in the "predict token t+1" layout (`xray.data.columns`); `mask` is
`LOSS_MASK` (0 on a dropped sample's row). Rows come in groups of `n`: the responses to one prompt
are rows `g*n .. g*n+n-1`. An estimator returns `(advantages [B, T-1], returns [B, T-1] or None)`
(`algorithms.core.registry.register_adv_est`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from xray.config.critic_free import CriticFreeConfig
from xray.config.schema import PPOConfig


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's inputs to an advantage estimator."""

    scores: torch.Tensor
    """`[B]` each response's score, already shaped (`algorithms.core.rewards.run_scores`)."""
    mask: torch.Tensor
    """`[B, T-1]` LOSS_MASK: 1 on the positions that predict a response token."""
    logprobs: torch.Tensor
    """`[B, T-1]` the actor's (old policy's) log-probs of the sampled tokens."""
    ref_logprobs: Optional[torch.Tensor] = None
    """`[B, T-1]` the reference's log-probs, where a KL to it enters the step; else None."""
    values: Optional[torch.Tensor] = None
    """`[B, T-1]` the critic's values (GAE); None without a critic."""
    valid: Optional[torch.Tensor] = None
    """`[B]` bool: False for a sample dropped for a non-finite score; None: all valid."""
    teacher_logprobs: Optional[torch.Tensor] = None
    """`[B, T-1]` a teacher's log-probs of the same tokens (on-policy distillation); else None."""
    kl_coef: float = 0.0
    """The KL's weight where it goes in the reward (per nat of k1); 0 where it does not."""
    n: int = 1
    """Responses per prompt (`rollout.n_samples`): the group size."""
    ppo: PPOConfig = PPOConfig()
    """The run's `ppo` section: `gamma`, `lam`, `whiten_advantages`, `whiten_min_std`."""
    critic_free: CriticFreeConfig = CriticFreeConfig()
    """The run's `critic_free` section: `scale_by_std`."""
