"""The specs of the registered commands, by name, for code in this repository (the tests, the
benchmarks, the jobs that start another, such as a warm start's sft): the same registry the CLI
reads (`xray/commands.py`, entry points of `xray.commands` in `pyproject.toml`).
"""
from __future__ import annotations

from pathlib import Path

from xray.commands import load
from xray.config import CONFIG_DIR
from xray.config.job import JobSpec


def command_spec(name: str) -> JobSpec:
    """The spec of command `name` (ppo, grpo, ..., sft); KeyError listing the registered ones."""
    return load(name)


def default_config(name: str) -> Path:
    """Command `name`'s default config file (`configs/`)."""
    return CONFIG_DIR / command_spec(name).config
