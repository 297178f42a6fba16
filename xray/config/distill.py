"""The `distill` section: supervised distillation on a sampled dataset, and the teacher of
on-policy distillation; and when a run starts the `teacher` role.

Sits in the config layer. `python -m xray.train distill` fine-tunes on a dataset `xray.train
sample` wrote (`algorithms/distill.py`). On-policy distillation has the student (the actor) sample
and a `teacher` WholeModel (the `teacher` role section: any model a training backend loads,
forward only) score the same tokens: its per-token log-prob less the student's, the negative
reverse KL, is the advantage of `python -m xray.train opd`, or is added with `teacher_coef` to the
advantages of ppo, grpo, rloo and reinforce_pp (`algorithms/critic_free/advantages.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from xray.config.typed import ConfigError

if TYPE_CHECKING:
    from xray.config.schema import RunConfig

TEACHER_TAKERS = ("ppo", "grpo", "rloo", "reinforce_pp")
"""The commands `distill.teacher_coef` adds the teacher's term to (`opd` has it alone)."""


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


def teacher_needed(cfg: "RunConfig", algo: str) -> bool:
    """Whether a run of `algo` starts the `teacher` role."""
    return algo == "opd" or (algo in TEACHER_TAKERS and cfg.distill.teacher_coef > 0)


def check_teacher(cfg: "RunConfig", algo: str) -> None:
    """The teacher's cross-field checks; a ConfigError that says the fix."""
    t = cfg.teacher
    if cfg.distill.teacher_coef < 0:
        raise ConfigError(f"distill.teacher_coef={cfg.distill.teacher_coef} must be >= 0 (0: no teacher)")
    if not teacher_needed(cfg, algo):
        if algo in TEACHER_TAKERS and cfg.device_groups.group_of("teacher") is not None:  # (sft: a warm start)
            raise ConfigError(f"device_groups: {algo} starts no teacher (distill.teacher_coef is 0); remove "
                              "'teacher' from its group's workers, or set --distill.teacher_coef")
        return
    if not t.model_path:
        raise ConfigError("the teacher scores the student's samples: set teacher.model_path to a Hugging Face "
                          "directory with the student's tokenizer, or builtin:tiny-llama-teacher")
    if t.lora is not None or t.elasticity is not None:
        raise ConfigError("teacher: it never trains and keeps its devices; remove teacher.lora and teacher.elasticity")
