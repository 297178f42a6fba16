"""The actor's policy loss of a run, built from its config (`algorithms/core`, the shared RL math):
the `ppo` section's clip ranges, aggregation, guard and registered policy loss (`ppo.policy_loss`:
vanilla, gspo, cispo), plus what the run machinery decided (`xray.run.algorithm.LossFacts`: the
behaviour weight of off-policy samples, an on-policy step, routing replay, the end-to-end bound).
Every algorithm's spec builds its actor's loss here.
"""
from __future__ import annotations

from algorithms.core.policy_loss import PolicyLoss
from xray.config.schema import PPOConfig
from xray.run.algorithm import LossFacts


def policy_loss_of(ppo: PPOConfig, facts: LossFacts, kl_coef: float = 0.0, kl_estimator: str = "k3") -> PolicyLoss:
    """The actor's loss with the run's clip ranges, aggregation and guard (`kl_coef`: a KL loss
    term with `kl_estimator`), and the run's facts."""
    return PolicyLoss(cliprange=ppo.cliprange, behaviour_weight_cap=facts.behaviour_weight_cap,
                      cliprange_high=ppo.cliprange_high, loss_agg_mode=ppo.loss_agg_mode, kl_coef=kl_coef,
                      kl_estimator=kl_estimator, max_approx_kl=ppo.max_approx_kl, on_policy=facts.on_policy,
                      end_to_end_bound=facts.end_to_end_bound, routing=facts.routing, name=ppo.policy_loss)
