"""On-policy distillation's per-token term (Agarwal et al. 2024; Lu and Thinking Machines 2025),
shared by every algorithm that adds a teacher (`algorithms/core`, the shared RL math), and its
advantage estimator `opd`: that term alone.

    A_t = c (log pi_teacher(y_t) - log pi_student(y_t))

the negative per-token reverse KL of the sampled token, not discounted, not normalised (`opd`
with c = 1; added to another algorithm's advantages with c = `distill.teacher_coef`).
"""
from __future__ import annotations

from typing import Optional

import torch

from algorithms.core.advantage_inputs import AdvantageInputs
from algorithms.core.registry import register_adv_est


def teacher_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """`[B, T-1]`: `coef` x (teacher's - student's log-prob of each sampled token) on the response
    positions of `mask`, 0 elsewhere. Positive where the teacher finds the student's token likelier
    than the student does: minimising the reverse KL, one sampled token at a time."""
    return coef * (teacher.float() - student.float()) * mask.to(torch.float32)


def teacher_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`distill/reverse_kl`: the mean over response tokens of student - teacher log-prob of the
    sampled token (the k1 estimate of KL(student || teacher), what on-policy distillation lowers);
    `distill/teacher_logprob`: the teacher's mean log-prob of the student's tokens."""
    m = mask.float()
    tokens = m.sum().clamp(min=1.0)
    return {"distill/reverse_kl": float(((student.float() - teacher.float()) * m).sum() / tokens),
            "distill/teacher_logprob": float((teacher.float() * m).sum() / tokens)}


@register_adv_est("opd")
def opd(inp: AdvantageInputs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """On-policy distillation: the teacher's term alone (weight 1); no returns."""
    if inp.teacher_logprobs is None:
        raise ValueError("the opd advantage estimator needs the teacher's log-probs (teacher_logprobs); "
                         "set teacher.model_path and put 'teacher' in a device group's workers")
    return teacher_advantages(inp.logprobs, inp.teacher_logprobs, inp.mask), None
