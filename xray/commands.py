"""The registry of `python -m xray.train` commands, which the algorithms layer fills.

`xray` never imports `algorithms`: each command's spec (`xray.config.job.JobSpec`: its roles,
checks, default config, `command(cfg, plan, output_dir, args) -> result line`, and an RL
algorithm's object) is an installed entry point of the group `xray.commands` (see
`pyproject.toml`), `name = "module:SPEC"`, loaded only when that command is named. A third-party
package adds an algorithm the same way, with its own entry point.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from xray.config.job import JobSpec

GROUP = "xray.commands"


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


def load(name: str) -> JobSpec:
    """The spec of command `name`, imported now."""
    commands = registered()
    if name not in commands:
        raise KeyError(f"unknown command {name!r}; registered: {', '.join(sorted(commands))}")
    found = commands[name].load()
    if not isinstance(found, JobSpec) or found.name != name:
        raise TypeError(f"entry point {GROUP}:{name} = {commands[name].value} is not the JobSpec named {name!r}; "
                        "point it at the command's spec object")
    return found
