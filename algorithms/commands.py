"""The algorithms' `python -m xray.train` commands, registered as `xray.commands` entry points
(`pyproject.toml`; the registry is `xray.commands`). Each runs its job and returns the result
line the CLI prints once Ray is down.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from xray.config.plan import Plan
from xray.config.schema import RunConfig


def rl(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """ppo and the critic-free grpo, rloo, reinforce_pp and opd."""
    from algorithms.ppo.run import run_ppo

    before, after = run_ppo(cfg, plan, output_dir, args.resume, args.ray_address, args.algo)
    return f"eval_before={before:.4f} eval_after={after:.4f}"


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

    return f"sft_model={sft_command(cfg, plan, output_dir, args.ray_address)}"


def pt(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """Continued pre-training on plain text."""
    from algorithms.pt import pt_command

    r = pt_command(cfg, plan, output_dir, args.ray_address)
    return (f"pt_model={r.model} chunks={r.chunks} loss_first={r.loss_first:.4f} loss_last={r.loss_last:.4f} "
            f"eval_loss_before={r.eval_loss_before:.4f} eval_loss_after={r.eval_loss_after:.4f}")
