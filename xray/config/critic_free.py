"""The `critic_free` section (GRPO, RLOO, REINFORCE++ and on-policy distillation).

Sits in the config layer: the typed settings the critic-free algorithms (`algorithms/critic_free`)
read. Where each puts its KL to the reference, and their cross-field checks, are theirs
(`algorithms/critic_free/spec.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class CriticFreeConfig:
    """GRPO, RLOO, REINFORCE++ and on-policy distillation (`opd`): what sets them apart from PPO
    (`algorithms/critic_free`)."""

    scale_by_std: bool = True
    """GRPO divides each group's centred rewards by the group's std; false: Dr. GRPO."""
    kl_in: Literal["auto", "loss", "reward", "none"] = "auto"
    """Where the KL to the reference goes: a loss term (kl_coef x estimate), a penalty on the
    reward, or nowhere (no reference model is started). auto: as each paper, loss for grpo,
    reward for rloo and reinforce_pp, none for opd."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimate of the loss term (the reward penalty is k1)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the
    batch's groups vary, at most `max_sample_rounds` rounds (then dropped groups fill it); metrics count it."""
    max_sample_rounds: int = 3
    """Rounds of sampling per step at most with `dynamic_sampling` (the first included)."""
