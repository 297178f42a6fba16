"""The RL command shared by every RL algorithm's spec (`python -m xray.train ppo`, grpo, rloo,
reinforce_pp, opd): warm-start what the config names (`algorithms/warm_start.py`), then hand the
run machinery (`xray/run/loop.py`) the spec's algorithm object. `rl_trainer` starts the same run's
trainer for the tests and benchmarks.
"""
from __future__ import annotations

import argparse
from contextlib import AbstractContextManager
from pathlib import Path

from algorithms.specs import command_spec
from algorithms.warm_start import model_dir, with_teacher_dir
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.run.loop import run_rl, started
from xray.run.outputs import RunDir


def warm(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None) -> tuple[str, RunConfig]:
    """The actor's model directory (a built-in model built and warm-started) and the config with
    the teacher's directory (built if built-in)."""
    directory = model_dir(cfg, plan, run, ray_address)
    return directory, with_teacher_dir(cfg, plan, run, ray_address)


def command(cfg: RunConfig, plan: Plan, output_dir: Path, args: argparse.Namespace) -> str:
    """The whole run of the command `args.algo`; its result line."""
    algorithm = command_spec(args.algo).algorithm(cfg)
    before, after = run_rl(cfg, plan, output_dir, args.resume, args.ray_address, algorithm, warm)
    return f"eval_before={before:.4f} eval_after={after:.4f}"


def rl_trainer(cfg: RunConfig, plan: Plan, run: RunDir, ray_address: str | None = None,
               algo: str = "ppo") -> AbstractContextManager:
    """The started trainer of RL command `algo` and its RunData, `with rl_trainer(...) as (trainer,
    data)`: the WholeModels are shut down on the way out."""
    return started(cfg, plan, run, command_spec(algo).algorithm(cfg), warm, ray_address)
