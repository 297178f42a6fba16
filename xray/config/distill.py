"""The `distill` section: supervised distillation on a sampled dataset, and the teacher of
on-policy distillation.

Sits in the config layer. `python -m xray.train distill` fine-tunes on a dataset `xray.train
sample` wrote (`algorithms/distill.py`). On-policy distillation has the student (the actor) sample
and a `teacher` WholeModel (the `teacher` role section: any model a training backend loads,
forward only) score the same tokens: its per-token log-prob less the student's, the negative
reverse KL, is the advantage of `python -m xray.train opd`, or is added with `teacher_coef` to the
advantages of ppo, grpo, rloo and reinforce_pp (`algorithms/core/teacher.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DistillConfig:
    """Distillation: `python -m xray.train distill` (`algorithms/distill.py`), supervised
    fine-tuning of `model.path` (the actor role, with the `sft` section's steps, batch and lr) on a
    dataset `xray.train sample` wrote; and the teacher's weight in on-policy distillation."""

    dataset: Optional[str] = None
    """The JSONL or Parquet file to learn from (`sample.output_file` of a sample run)."""
    response_field: str = "response"
    """The column holding the response to imitate (the prompt column is `data.prompt_field`)."""
    teacher_coef: float = 0.0
    """On ppo, grpo, rloo and reinforce_pp: add this times the teacher's minus the actor's log-prob
    of each sampled token (the negative per-token reverse KL) to its advantage; the `teacher` role
    (`teacher.model_path`) scores the samples. 0: no teacher. `opd` uses the term alone (weight 1)."""
