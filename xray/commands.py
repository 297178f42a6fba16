"""The registry of `python -m xray.train` commands, which the algorithms layer fills.

`xray` never imports `algorithms`: each algorithm's command is an installed entry point of the
group `xray.commands` (see `pyproject.toml`), `name = "module:function"`, loaded only when that
command runs. A command is `function(cfg, plan, output_dir, args) -> str`: it runs the job and
returns the one result line the CLI prints (after Ray is shut down). A third-party package adds an
algorithm the same way, with its own entry point.
"""
from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Callable

from xray.config.plan import Plan
from xray.config.schema import RunConfig

GROUP = "xray.commands"
Command = Callable[[RunConfig, Plan, Path, argparse.Namespace], str]


class NoCommandsError(RuntimeError):
    """No algorithm is registered: the package's metadata is missing."""


def registered() -> dict[str, EntryPoint]:
    """Every registered command by name (reading metadata only; nothing is imported)."""
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if not found:
        raise NoCommandsError(f"no xray commands are registered (entry point group {GROUP!r}): install the "
                              "package so its metadata exists, e.g. `pip install --no-deps -e .` in the "
                              "repository (`make install` does it)")
    return found


def load(name: str) -> Command:
    """The command `name`, imported now."""
    commands = registered()
    if name not in commands:
        raise KeyError(f"unknown command {name!r}; registered: {', '.join(sorted(commands))}")
    return commands[name].load()
