"""`python -m xray.train ALGO`: the command users run.

    python -m xray.train ppo [--backend megatron-vllm] [--config FILE] [--output-dir DIR]
                             [--resume [DIR]] [--ray-address ADDR] [--dry-run] [-v | --quiet]
                             [--a.b.c=VALUE ...]

ALGO: ppo, the critic-free grpo, rloo and reinforce_pp, opd (on-policy distillation from a
teacher), sft, rm (a reward model trained on
preference pairs), sample (best-of-N candidates scored by the sampler/prm/orm roles, written as a
dataset), distill (fine-tuning on that dataset) or pt (continued pre-training on plain text).
Loads and checks the config (defaults: `configs/ppo_tiny_cpu.yaml`,
`configs/critic_free_tiny_cpu.yaml`, `configs/opd_tiny_cpu.yaml`, `configs/sample_tiny_cpu.yaml`),
builds the placement plan, and runs the algorithm: a command the algorithms layer registered
(`xray.commands`). `--dry-run` prints the resolved config and the plan without starting Ray. User
mistakes end with a one-line message on stderr and exit code 2, no traceback; a node that ran out
of memory ends with its largest processes and the overrides that lower them (`xray.run.out_of_memory`),
exit code 1. `-v` adds DEBUG lines,
`--quiet` keeps only warnings, errors and the result line (`xray.run.console`).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

import yaml

from xray.backends import BackendError
from xray.commands import load, registered
from xray.config import CONFIG_DIR, ConfigError, LayoutError, load_config, to_dict
from xray.config.engines import PAIRS
from xray.config.plan import plan_run
from xray.run.console import console_flags, console_level, setup_console
from xray.run import out_of_memory
from xray.run.graceful import RunInterrupted
from xray.run.loggers import check_loggers

log = logging.getLogger("xray.train")


class UsageError(ValueError):
    """A command-line mistake; the message says the fix."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xray.train", allow_abbrev=False, parents=[console_flags()],
                                description="Train a language model with reinforcement learning on Ray.",
                                epilog="Any config key can be overridden: --ppo.kl_coef=0.05")
    p.add_argument("algo", choices=list(registered()), help="the algorithm to run")
    p.add_argument("--backend", default=PAIRS[0], help=f"TRAIN-GENERATION pair: {', '.join(PAIRS)}")
    p.add_argument("--config", default=None, help="YAML config (default: the algorithm's in configs/)")
    p.add_argument("--output-dir", default=None, help="where the run writes (default: runs/<algo>-<time>)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest checkpoint of --output-dir, or of DIR")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or a local one)")
    p.add_argument("--dry-run", action="store_true", help="check the config, print it and the placement plan, and stop")
    return p


def resolve(argv: list[str]):
    args, extra = parser().parse_known_args(argv)
    spec = load(args.algo)
    config_path = Path(args.config) if args.config else CONFIG_DIR / spec.config
    cfg = load_config(config_path, extra)
    if args.backend not in PAIRS:
        raise UsageError(f"unknown --backend {args.backend!r}; choose one of {', '.join(PAIRS)}")
    plan = plan_run(cfg, args.backend, spec)
    check_loggers(cfg.trainer.loggers)  # an optional logger's package: missing is one line, before anything starts
    output_dir = Path(args.output_dir or f"runs/{args.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args, cfg, plan, config_path, output_dir


def shutdown_ray() -> None:
    from xray.wholemodel.cluster import shutdown_ray as stop

    stop()


def user_errors() -> tuple[type[BaseException], ...]:
    """Mistakes in the command, config, data or reward spec: a one-line message, no traceback."""
    from xray.data.conversation import ConversationError
    from xray.data.files import DataFileError
    from xray.data.prompts import PromptDataError
    from xray.data.text import TextDataError
    from xray.rewards.loader import RewardSpecError
    from xray.builtin.tasks import TaskError

    return (ConfigError, BackendError, UsageError, LayoutError, FileNotFoundError, PromptDataError,
            DataFileError, ConversationError, TextDataError, RewardSpecError, TaskError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    setup_console(console_level(console_flags(exclusive=False).parse_known_args(argv)[0]))
    try:
        args, cfg, plan, config_path, output_dir = resolve(argv)
        spec = load(args.algo)
        if args.dry_run:
            sys.stdout.write(f"# config: {config_path} (backend {args.backend})\n")
            sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            sys.stdout.write(plan.describe() + "\n")
            return 0
        out = sys.stdout  # the result line's; anything else printed meanwhile goes to stderr (Ray prints
        # a dead worker's error, and the workers' own stdout lines, to the driver's sys.stdout)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                result = spec.command(cfg, plan, output_dir, args)
        except RunInterrupted as stop:
            with contextlib.redirect_stdout(sys.stderr):
                shutdown_ray()
            out.write(f"stopped: the latest checkpoint is step {stop.step}; continue with:\n  {stop.resume}\n")
            return 0
        except Exception as exc:
            if (message := out_of_memory.explain(exc, cfg, plan)) is None:
                raise
            with contextlib.redirect_stdout(sys.stderr):
                shutdown_ray()
            sys.stderr.write(f"error: {message}\n")  # Ray's own 60 lines are above it, on stderr
            return 1
        with contextlib.redirect_stdout(sys.stderr):
            shutdown_ray()  # no Workhorse log line may land after the result
        out.write(result + "\n")
        return 0
    except user_errors() as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
