"""The `critic_free` section (GRPO, RLOO, REINFORCE++ and on-policy distillation) and its checks.

Sits in the config layer: the typed settings the critic-free trainer (`algorithms/critic_free`)
reads, where each algorithm puts its KL to the reference (`kl_placement`, which also decides
whether a reference model starts), and the cross-field checks `xray.config.plan` runs for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from xray.config.typed import ConfigError

if TYPE_CHECKING:
    from xray.config.schema import RunConfig

CRITIC_FREE = ("grpo", "rloo", "reinforce_pp", "opd")
"""The commands the critic-free trainer runs (`opd`: on-policy distillation, `algorithms/critic_free`)."""
PAPER_KL = {"grpo": "loss", "rloo": "reward", "reinforce_pp": "reward", "opd": "none"}
"""Where each paper puts the KL to the reference (`critic_free.kl_in: auto`); on-policy
distillation's only signal is the teacher's."""


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


def kl_placement(cfg: "RunConfig", algo: str) -> str:
    """`loss`, `reward` or `none`: where `algo`'s KL to the reference goes in this run."""
    return PAPER_KL[algo] if cfg.critic_free.kl_in == "auto" else cfg.critic_free.kl_in


def check_critic_free(cfg: "RunConfig", algo: str) -> None:
    """The critic-free runs' cross-field checks; a ConfigError that says the fix."""
    groups = cfg.device_groups
    if groups.group_of("critic") is not None:
        raise ConfigError(f"device_groups: {algo} has no critic; remove 'critic' from its group's workers")
    if kl_placement(cfg, algo) == "none" and groups.group_of("reference") is not None and cfg.actor.lora is None:
        raise ConfigError(f"device_groups: {algo} with critic_free.kl_in={cfg.critic_free.kl_in} starts no reference "
                          "model; remove 'reference' from its group's workers, or set critic_free.kl_in")
    if algo in ("grpo", "rloo") and cfg.rollout.n_samples < 2:
        raise ConfigError(f"{algo} compares the responses to one prompt: rollout.n_samples={cfg.rollout.n_samples}; "
                          "set --rollout.n_samples to 2 or more (4 to 16 is usual)")
    if cfg.trainer.mode != "sync" and cfg.critic_free.dynamic_sampling:
        raise ConfigError("critic_free.dynamic_sampling draws more prompts within a synchronous step; an asynchronous "
                          "run's makers cannot refill it: set trainer.mode=sync, or dynamic_sampling=false")
    if cfg.actor.elasticity is not None or cfg.reference.elasticity is not None:
        raise ConfigError(f"{algo}: elastic device groups are PPO's for now; remove the elasticity blocks")
    if cfg.critic_free.dynamic_sampling and (cfg.env.episodes or cfg.critic_free.max_sample_rounds < 1):
        raise ConfigError("critic_free.dynamic_sampling samples completions (no env), max_sample_rounds >= 1")
    if cfg.critic_free.dynamic_sampling and algo == "opd":
        raise ConfigError("critic_free.dynamic_sampling filters groups by reward; opd learns from the teacher "
                          "alone: set it to false, or run grpo with --distill.teacher_coef")
