"""The jobs' `python -m xray.train` commands and their specs (sft, pt, rm, sample, distill), each
registered as an `xray.commands` entry point (`pyproject.toml`; the registry is `xray/commands.py`).
Each runs its job and returns the result line the CLI prints once Ray is down. The RL algorithms'
specs live with them (`algorithms/ppo/spec.py`, `algorithms/critic_free/spec.py`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from xray.config.job import JobSpec
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError


def rm(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """A reward model trained on preference pairs."""
    from algorithms.rm import rm_command

    directory, before, after = rm_command(cfg, plan, output_dir, args.ray_address)
    return f"rm_model={directory} eval_accuracy_before={before:.4f} eval_accuracy_after={after:.4f}"


def sample(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """Best-of-N candidates scored by the sampler/prm/orm roles, written as a dataset."""
    from algorithms.sample import sample_command

    s = sample_command(cfg, plan, output_dir, args.ray_address)
    return (f"sample_dataset={s.path} prompts={s.prompts} candidates={s.candidates} rows={s.rows} "
            f"prompts_passed={s.prompts_passed} orm_mean={s.orm_mean:.4f} orm_kept={s.orm_kept:.4f}")


def distill(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """Fine-tuning on a sampled dataset."""
    from algorithms.distill import distill_command

    d = distill_command(cfg, plan, output_dir, args.ray_address)
    return f"distill_model={d.model} rows={d.rows} loss_first={d.loss_first:.4f} loss_last={d.loss_last:.4f}"


def sft(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """Supervised fine-tuning on the data's (prompt, answer) rows."""
    from algorithms.sft import sft_command

    return f"sft_model={sft_command(cfg, plan, output_dir, args.ray_address, args.resume)}"


def pt(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """Continued pre-training on plain text."""
    from algorithms.pt import pt_command

    r = pt_command(cfg, plan, output_dir, args.ray_address)
    return (f"pt_model={r.model} chunks={r.chunks} loss_first={r.loss_first:.4f} loss_last={r.loss_last:.4f} "
            f"eval_loss_before={r.eval_loss_before:.4f} eval_loss_after={r.eval_loss_after:.4f}")


def actor_alone(cfg: RunConfig) -> tuple[str, ...]:
    return ("actor",)


def sample_roles(cfg: RunConfig) -> tuple[str, ...]:
    return ("sampler", *(("prm",) if cfg.sample.prm_model else ()),
            *(("orm",) if cfg.reward.specs or cfg.reward.model else ()))


def check_sample(cfg: RunConfig) -> None:
    """The sample job's cross-field checks; a ConfigError that says the fix."""
    groups, s = cfg.device_groups, cfg.sample
    if groups.group_of("prm") is not None and not s.prm_model:
        raise ConfigError("device_groups: role 'prm' is placed but sample.prm_model is not set; set it to a "
                          "sequence-classification directory, or remove 'prm' from its group's workers")
    if groups.group_of("orm") is not None and not (cfg.reward.specs or cfg.reward.model):
        raise ConfigError("device_groups: role 'orm' is placed but the reward has neither function nor model; "
                          "set reward.function or reward.model, or remove 'orm' from its group's workers")
    if s.n_best < 1 or s.batch_prompts < 1 or s.num_prompts < 0:
        raise ConfigError(f"sample: n_best={s.n_best} and batch_prompts={s.batch_prompts} must be at least 1, "
                          f"num_prompts={s.num_prompts} at least 0 (0: every prompt)")
    if s.batch_prompts % cfg.rollout.dp:
        raise ConfigError(f"sample.batch_prompts={s.batch_prompts} is not divisible by the {cfg.rollout.dp} sampler "
                          "replicas (rollout.dp); use a multiple of it")
    if not s.step_separator:
        raise ConfigError("sample.step_separator is empty; give the text that ends a step, e.g. '\\n'")


SFT = JobSpec(name="sft", kind="supervised", config="ppo_tiny_cpu.yaml", roles=actor_alone, command=sft, elastic=True)
PT = JobSpec(name="pt", kind="supervised", config="ppo_tiny_cpu.yaml", roles=actor_alone, command=pt, elastic=True)
DISTILL = JobSpec(name="distill", kind="supervised", config="critic_free_tiny_cpu.yaml", roles=actor_alone,
                  command=distill, elastic=True)
RM = JobSpec(name="rm", kind="reward_model", config="ppo_tiny_cpu.yaml", roles=lambda cfg: ("critic",), command=rm)
SAMPLE = JobSpec(name="sample", kind="best_of_n", config="sample_tiny_cpu.yaml", roles=sample_roles, check=check_sample,
                 command=sample)
