"""The critic-free family as the run machinery sees it: GRPO, RLOO, REINFORCE++ and on-policy
distillation (`opd`), each a spec (`python -m xray.train grpo` ...) and one algorithm object.

PPO's clipped policy update (`ppo.policy_loss`: vanilla, gspo, cispo) on the actor alone, the value
model replaced by the other responses to the same prompt (the registered estimators of
`algorithms/critic_free/advantages.py`) or by a teacher's judgement of each sampled token (`opd`,
`algorithms/core/teacher.py`). The KL to the reference goes where each paper puts it
(`critic_free.kl_in: auto`): a loss term (grpo), a penalty on the reward (rloo, reinforce_pp), or
nowhere (opd: no reference model starts). With `critic_free.dynamic_sampling` (DAPO) the step
samples more rounds of prompts until the batch's groups vary (`algorithms/critic_free/dynamic.py`).
No critic starts; checkpoints hold the actor alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from algorithms.core.actor_loss import policy_loss_of
from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.kl_control import build_kl_controller
from algorithms.core.kl_estimators import kl_metrics
from algorithms.core.registry import adv_estimator
from algorithms.core.rewards import run_scores
from algorithms.core.teacher import teacher_advantages, teacher_metrics
from algorithms.ppo.spec import rl_roles
from xray.config.job import JobSpec
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError
from xray.data import columns as C
from xray.run.algorithm import Experience, LossFacts

PAPER_KL = {"grpo": "loss", "rloo": "reward", "reinforce_pp": "reward", "opd": "none"}
"""Where each paper puts the KL to the reference (`critic_free.kl_in: auto`); on-policy
distillation's only signal is the teacher's."""


def kl_placement(cfg: RunConfig, algo: str) -> str:
    """`loss`, `reward` or `none`: where `algo`'s KL to the reference goes in this run."""
    return PAPER_KL[algo] if cfg.critic_free.kl_in == "auto" else cfg.critic_free.kl_in


@dataclass(frozen=True)
class CriticFree:
    """A critic-free algorithm's object (`xray.run.algorithm.Algorithm`): `name` picks its
    registered advantage estimator."""

    cfg: RunConfig
    name: str = "grpo"
    trained: ClassVar[tuple[str, ...]] = ("actor",)
    skips_old_forward: ClassVar[bool] = True

    @property
    def kl_in(self) -> str:
        return kl_placement(self.cfg, self.name)

    @property
    def teacher_coef(self) -> float:
        return 1.0 if self.name == "opd" else self.cfg.distill.teacher_coef

    def kl_controller(self):
        ppo = self.cfg.ppo
        return build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)

    def losses(self, facts: LossFacts) -> dict[str, Any]:
        cfg = self.cfg
        kl_coef = cfg.ppo.kl_coef if self.kl_in == "loss" else 0.0
        return {"actor": policy_loss_of(cfg.ppo, facts, kl_coef, cfg.critic_free.kl_estimator)}

    def targets(self, e: Experience, kl_coef: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The estimator's advantages over each prompt's group (rows of `e.valid` False left out of
        their group's statistics), the KL where `critic_free.kl_in` puts it, plus the teacher's term
        (`opd`: that term alone)."""
        shaped = run_scores(torch.where(e.mask.sum(1) > 0, e.scores.float(), 0.0), e.mask, self.cfg)
        inp = AdvantageInputs(shaped, e.mask, e.logprobs, e.ref_logprobs, valid=e.valid,
                              teacher_logprobs=e.teacher_logprobs,
                              kl_coef=kl_coef if self.kl_in == "reward" else 0.0, n=self.cfg.rollout.n_samples,
                              ppo=self.cfg.ppo, critic_free=self.cfg.critic_free)
        advantages = adv_estimator(self.name)(inp)[0]
        if self.name != "opd" and e.teacher_logprobs is not None:
            advantages = advantages + teacher_advantages(e.logprobs, e.teacher_logprobs, e.mask, self.teacher_coef)
        columns = {C.ADVANTAGES: advantages, **({C.REF_LOGPROBS: e.ref_logprobs} if self.kl_in == "loss" else {})}
        metrics = kl_metrics(e.logprobs, e.ref_logprobs, e.mask) if e.ref_logprobs is not None else {}
        if e.teacher_logprobs is not None:
            metrics.update(teacher_metrics(e.logprobs, e.teacher_logprobs, e.mask))
        return columns, metrics

    def wants_more(self, rounds: list, groups: int) -> bool:
        """With dynamic sampling: while fewer than `groups` groups vary, up to `max_sample_rounds`."""
        from algorithms.critic_free.dynamic import varied_count

        cf, n = self.cfg.critic_free, self.cfg.rollout.n_samples
        return (cf.dynamic_sampling and len(rounds) < cf.max_sample_rounds
                and sum(varied_count(r, n) for r in rounds) < groups)

    def select(self, rounds: list, groups: int):
        if not self.cfg.critic_free.dynamic_sampling:
            return rounds[0], {}
        from algorithms.critic_free.dynamic import select

        return select(rounds, self.cfg.rollout.n_samples, groups)


def check(cfg: RunConfig, algo: str) -> None:
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


def _spec(name: str, config: str) -> JobSpec:
    def roles(cfg: RunConfig) -> tuple[str, ...]:
        reference = ["reference"] if kl_placement(cfg, name) != "none" else []
        return rl_roles(cfg, ["rollout", "actor", *reference], name == "opd" or cfg.distill.teacher_coef > 0)

    def command(cfg, plan, output_dir, args) -> str:
        from algorithms.rl import command as rl_command

        return rl_command(cfg, plan, output_dir, args)

    def algorithm(cfg: RunConfig) -> CriticFree:
        return CriticFree(cfg, name)

    return JobSpec(name=name, kind="rl", config=config, roles=roles, check=lambda cfg: check(cfg, name),
                   routing_replay=True, command=command, algorithm=algorithm)


GRPO = _spec("grpo", "critic_free_tiny_cpu.yaml")
RLOO = _spec("rloo", "critic_free_tiny_cpu.yaml")
REINFORCE_PP = _spec("reinforce_pp", "critic_free_tiny_cpu.yaml")
OPD = _spec("opd", "opd_tiny_cpu.yaml")
