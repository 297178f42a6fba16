"""PPO as the run machinery sees it: its spec (`python -m xray.train ppo`) and its algorithm object.

trlX-style PPO: per-token rewards `-kl_coef * (logp - ref_logp)` with the shaped score at the last
response token, GAE advantages (whitened, with a floor on the std) and returns (`algorithms/ppo/gae.py`,
the registered estimator `gae`), the clipped policy loss on the actor (`ppo.policy_loss`, vanilla
by default) and the clipped value loss on the critic (`algorithms/ppo/value_loss.py`), an adaptive
or fixed KL controller. With `distill.teacher_coef` a teacher's per-token term is added to the
advantages after whitening. The step itself is the run machinery's (`xray/run/step.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.actor_loss import policy_loss_of
from algorithms.core.kl_control import build_kl_controller
from algorithms.core.kl_estimators import kl_metrics
from algorithms.core.registry import adv_estimator
from algorithms.core.rewards import run_scores
from algorithms.core.teacher import teacher_advantages, teacher_metrics
from algorithms.ppo.value_loss import ValueLoss
from xray.config.job import JobSpec
from xray.config.schema import RunConfig
from xray.data import columns as C
from xray.run.algorithm import Experience, LossFacts


def rl_roles(cfg: RunConfig, roles: list[str], teacher: bool) -> tuple[str, ...]:
    """An RL run's roles: `roles`, less the reference when the actor trains LoRA adapters (the
    actor with its adapters off is the reference), plus a reward model and a teacher where used."""
    roles = list(roles)
    if cfg.actor.lora is not None and "reference" in roles:
        roles.remove("reference")
    if cfg.reward.model:
        roles.append("reward")
    return tuple(roles) + (("teacher",) if teacher else ())


@dataclass(frozen=True)
class PPO:
    """PPO's algorithm object (`xray.run.algorithm.Algorithm`)."""

    cfg: RunConfig
    name: str = "ppo"
    trained: ClassVar[tuple[str, ...]] = ("actor", "critic")
    kl_in: ClassVar[str] = "reward"
    skips_old_forward: ClassVar[bool] = False

    @property
    def teacher_coef(self) -> float:
        return self.cfg.distill.teacher_coef

    def kl_controller(self):
        ppo = self.cfg.ppo
        return build_kl_controller(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)

    def losses(self, facts: LossFacts) -> dict[str, Any]:
        ppo = self.cfg.ppo
        return {"actor": policy_loss_of(ppo, facts),
                "critic": ValueLoss(cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef)}

    def targets(self, e: Experience, kl_coef: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The KL-penalised per-token rewards, GAE, whitening; plus the teacher's term after
        whitening (it keeps its scale, as on the critic-free steps)."""
        inp = AdvantageInputs(run_scores(e.scores, e.mask, self.cfg), e.mask, e.logprobs, e.ref_logprobs,
                              e.values, kl_coef=kl_coef, n=self.cfg.rollout.n_samples, ppo=self.cfg.ppo,
                              critic_free=self.cfg.critic_free)
        advantages, returns = adv_estimator("gae")(inp)
        metrics = kl_metrics(e.logprobs, e.ref_logprobs, e.mask)
        if e.teacher_logprobs is not None:
            advantages = advantages + teacher_advantages(e.logprobs, e.teacher_logprobs, e.mask, self.teacher_coef)
            metrics.update(teacher_metrics(e.logprobs, e.teacher_logprobs, e.mask))
        return {C.OLD_VALUES: e.values, C.ADVANTAGES: advantages, C.RETURNS: returns}, metrics

    def wants_more(self, rounds: list, groups: int) -> bool:
        return False

    def select(self, rounds: list, groups: int):
        return rounds[0], {}


def ppo_roles(cfg: RunConfig) -> tuple[str, ...]:
    return rl_roles(cfg, ["rollout", "actor", "critic", "reference"], cfg.distill.teacher_coef > 0)


def _command(cfg, plan, output_dir, args) -> str:
    from algorithms.rl import command

    return command(cfg, plan, output_dir, args)


SPEC = JobSpec(name="ppo", kind="rl", config="ppo_tiny_cpu.yaml", roles=ppo_roles, elastic=True,
               command=_command, algorithm=PPO)
"""`python -m xray.train ppo`."""
