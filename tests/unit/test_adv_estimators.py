"""Advantage estimators by name (`algorithms/core/registry.py`): each registered estimator gives,
bit for bit on random inputs, what the trainers computed before the registry, written out here from
the same functions (PPO's targets after the score shaping: KL-penalised rewards, GAE, whitening;
the critic-free step's `algorithm_advantages`; on-policy distillation's teacher term); the lookup,
its error, and the errors for missing inputs."""
import dataclasses

import pytest
import torch

from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.kl_estimators import kl_terms
from algorithms.core.masked import whiten
from algorithms.core.registry import adv_estimator, adv_estimator_names
from algorithms.core.rewards import kl_penalized_rewards
from algorithms.core.teacher import teacher_advantages
from algorithms.critic_free.advantages import grpo_advantages, per_token, reinforce_pp_advantages, rloo_advantages
from algorithms.ppo.gae import gae
from xray.config.critic_free import CriticFreeConfig
from xray.config.schema import PPOConfig

pytestmark = pytest.mark.unit

N, GROUPS, T = 4, 3, 11


def _inputs(seed: int, kl_coef: float, **ppo) -> AdvantageInputs:
    """A step's random inputs: groups of N responses of different lengths, one sample dropped (its
    mask row zeroed, as the trainers do), critic values, reference and teacher log-probs."""
    g = torch.Generator().manual_seed(seed)
    b = N * GROUPS
    lengths = torch.randint(1, T, (b,), generator=g)
    valid = torch.ones(b, dtype=torch.bool)
    valid[5] = False
    mask = ((torch.arange(T)[None, :] < lengths[:, None]) & valid[:, None]).float()
    scores = torch.where(valid, torch.randint(0, 3, (b,), generator=g).float(), 0.0)
    logp = lambda: -torch.rand(b, T, generator=g) * 3  # noqa: E731
    return AdvantageInputs(scores=scores, mask=mask, logprobs=logp(), ref_logprobs=logp(),
                           values=torch.randn(b, T, generator=g), valid=valid, teacher_logprobs=logp(),
                           kl_coef=kl_coef, n=N, ppo=PPOConfig(**ppo), critic_free=CriticFreeConfig())


def _old_ppo_targets(inp: AdvantageInputs):
    """PPO's targets as its trainer computed them once the scores were shaped."""
    ppo = inp.ppo
    rewards = kl_penalized_rewards(inp.logprobs, inp.ref_logprobs, inp.mask, inp.scores, inp.kl_coef)
    advantages, returns = gae(rewards, inp.values, inp.mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, inp.mask, min_std=ppo.whiten_min_std)
    return advantages, returns


def _old_algorithm_advantages(algo: str, inp: AdvantageInputs, ref_logprobs):
    """The critic-free trainer's `algorithm_advantages`, with `coef` the KL's weight in the reward."""
    coef, n, cf, scores, mask, logprobs = inp.kl_coef, inp.n, inp.critic_free, inp.scores, inp.mask, inp.logprobs
    if algo == "reinforce_pp":
        reference = logprobs if ref_logprobs is None else ref_logprobs
        rewards = kl_penalized_rewards(logprobs, reference, mask, scores, coef)
        return reinforce_pp_advantages(rewards, mask, inp.ppo.gamma, inp.ppo.whiten_min_std)
    if coef:
        scores = scores - coef * (kl_terms(logprobs, ref_logprobs, "k1") * mask).sum(1)
    if algo == "grpo":
        return per_token(grpo_advantages(scores, n, cf.scale_by_std, valid=inp.valid), mask)
    return per_token(rloo_advantages(scores, n, valid=inp.valid), mask)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kl_coef", [0.0, 0.07])
@pytest.mark.parametrize("ppo", [{}, {"whiten_advantages": False}, {"gamma": 0.9, "lam": 0.8, "whiten_min_std": 0.0}])
def test_gae_is_ppos_targets(seed, kl_coef, ppo):
    inp = _inputs(seed, kl_coef, **ppo)
    advantages, returns = adv_estimator("gae")(inp)
    old_advantages, old_returns = _old_ppo_targets(inp)
    assert torch.equal(advantages, old_advantages) and torch.equal(returns, old_returns)
    assert advantages.abs().sum() > 0 and returns.abs().sum() > 0


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kl_coef", [0.0, 0.07])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_critic_free_estimators_are_the_trainers(algo, seed, kl_coef, scale_by_std):
    inp = dataclasses.replace(_inputs(seed, kl_coef, gamma=0.95),
                              critic_free=CriticFreeConfig(scale_by_std=scale_by_std))
    advantages, returns = adv_estimator(algo)(inp)
    assert returns is None
    assert torch.equal(advantages, _old_algorithm_advantages(algo, inp, inp.ref_logprobs))
    assert advantages.abs().sum() > 0 and (advantages * (1 - inp.mask)).abs().sum() == 0


def test_reinforce_pp_without_a_reference_has_no_penalty():
    inp = dataclasses.replace(_inputs(2, 0.07), ref_logprobs=None)
    advantages, _ = adv_estimator("reinforce_pp")(inp)
    assert torch.equal(advantages, _old_algorithm_advantages("reinforce_pp", inp, None))


def test_opd_is_the_teacher_term_alone():
    inp = _inputs(3, 0.07)
    advantages, returns = adv_estimator("opd")(inp)
    assert returns is None
    assert torch.equal(advantages, teacher_advantages(inp.logprobs, inp.teacher_logprobs, inp.mask))


def test_the_registered_estimators_and_the_lookup_error():
    assert adv_estimator_names() == ("gae", "grpo", "opd", "reinforce_pp", "rloo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; choose one of gae, grpo, opd"):
        adv_estimator("ppo")


def test_missing_inputs_say_the_fix():
    inp = _inputs(4, 0.07)
    with pytest.raises(ValueError, match="needs the critic's values"):
        adv_estimator("gae")(dataclasses.replace(inp, values=None))
    with pytest.raises(ValueError, match="teacher.model_path"):
        adv_estimator("opd")(dataclasses.replace(inp, teacher_logprobs=None))
    with pytest.raises(ValueError, match="critic_free.kl_in"):
        adv_estimator("grpo")(dataclasses.replace(inp, ref_logprobs=None))
