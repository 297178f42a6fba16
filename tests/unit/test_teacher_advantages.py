"""On-policy distillation's advantage (`algorithms/core/teacher.py`): the teacher's
log-prob of each sampled token less the student's, by hand and as the Tinker cookbook's
`advantages -= coef * mask * (sampled - teacher)` on random inputs; its metrics; where it joins
GRPO's and PPO's advantages; and the config's teacher checks (`xray/config/distill.py`)."""
import pytest
import torch

from algorithms.core.teacher import teacher_advantages, teacher_metrics
from algorithms.critic_free.advantages import grpo_advantages, per_token

pytestmark = pytest.mark.unit


def test_reverse_kl_advantage_by_hand():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-2.1, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(teacher_advantages(student, teacher, mask),
                          torch.tensor([[0.5, -0.5, 0.0], [-2.0, 2.0, -9.0]]))
    assert torch.allclose(teacher_advantages(student, teacher, mask, 0.5),
                          torch.tensor([[0.25, -0.25, 0.0], [-1.0, 1.0, -4.5]]))
    m = teacher_metrics(student, teacher, mask)  # over the 5 response tokens
    assert m["distill/reverse_kl"] == pytest.approx((-0.5 + 0.5 + 2.0 - 2.0 + 9.0) / 5)
    assert m["distill/teacher_logprob"] == pytest.approx((-0.5 - 2.5 - 2.1 - 1.0 - 9.0) / 5)


def test_reverse_kl_advantage_as_the_tinker_cookbook_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(8, 12, generator=g) * 4, -torch.rand(8, 12, generator=g) * 4
    mask = (torch.rand(8, 12, generator=g) > 0.3).float()
    base = torch.randn(8, 12, generator=g) * mask
    tinker = base - 0.7 * mask * (student - teacher)  # its incorporate_kl_penalty, reward-free when base is 0
    assert torch.allclose(base + teacher_advantages(student, teacher, mask, 0.7), tinker, atol=1e-6)
    assert torch.allclose(teacher_advantages(student, teacher, mask), -mask * (student - teacher), atol=1e-6)
    # added to GRPO's per-sequence advantages, token by token: a group with equal rewards learns from it alone
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    joined = per_token(grpo_advantages(scores, 4), mask) + teacher_advantages(student, teacher, mask, 0.5)
    flat = joined[4:]
    assert torch.allclose(flat, 0.5 * (teacher - student)[4:] * mask[4:], atol=1e-6)


def test_teacher_config_says_the_fix():
    from xray.config import ConfigError
    from xray.train import resolve

    with pytest.raises(ConfigError, match="set teacher.model_path"):
        resolve(["opd", "--teacher.model_path=null"])
    with pytest.raises(ConfigError, match="starts no teacher"):
        resolve(["grpo", "--config", "configs/opd_tiny_cpu.yaml", "--rollout.n_samples=2"])
    with pytest.raises(ConfigError, match="teacher_coef=-1"):
        resolve(["grpo", "--distill.teacher_coef=-1"])
    with pytest.raises(ConfigError, match="role 'teacher' is placed in no group"):
        resolve(["grpo", "--distill.teacher_coef=0.5", "--teacher.model_path=/x"])
    with pytest.raises(ConfigError, match="dynamic_sampling filters groups by reward"):
        resolve(["opd", "--critic_free.dynamic_sampling=true"])
    groups = ["--device_groups.train_group.workers=[actor, reference, teacher]", "--teacher.model_path=/x"]
    _, cfg, plan, _, _ = resolve(["grpo", "--distill.teacher_coef=0.5", *groups])
    assert [r.role for r in plan.roles] == ["rollout", "actor", "reference", "teacher"]
    _, cfg, plan, _, _ = resolve(["opd", "--rollout.n_samples=1"])  # no group to compare: one sample is enough
    assert [r.role for r in plan.roles] == ["rollout", "actor", "teacher"]
