"""What the plan knows of a `python -m xray.train` command: its spec, handed in by the command.

Sits in the config layer, which names no algorithm: each command (an RL algorithm, or one of the
jobs sft, pt, rm, sample, distill) declares a `JobSpec` where it lives (`algorithms/`), registers
it as an entry point of `xray.commands` (`pyproject.toml`, read by `xray/commands.py`), and the
plan (`xray/config/plan.py`) reads only the spec's facts: the roles it starts, its config checks,
the kind of batches it trains, and whether it may use elastic groups or routing replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from xray.config.schema import RunConfig

Kind = Literal["rl", "supervised", "reward_model", "best_of_n"]
KINDS = ("rl", "supervised", "reward_model", "best_of_n")


def no_check(cfg: "RunConfig") -> None:
    """A spec without checks of its own."""


@dataclass(frozen=True)
class JobSpec:
    """One command of `python -m xray.train`, as the plan and the CLI see it."""

    name: str
    """The command's name (`ppo`, `grpo`, `sft`, ...)."""
    kind: Kind
    """`rl`: an RL run (rollout, synced weights, episodes, the run report); `supervised`: the actor
    alone on fixed data (the `sft` section's batches); `reward_model`: a reward model trained on
    preference pairs (the `rm` section's batches); `best_of_n`: best-of-N sampling by the
    sampler/prm/orm roles."""
    config: str
    """Its default config, a file name under `configs/`."""
    roles: Callable[["RunConfig"], tuple[str, ...]]
    """The roles a run of it starts, given the config (the `teacher` among them when it scores)."""
    check: Callable[["RunConfig"], None] = no_check
    """Its own cross-field checks; a ConfigError that says the fix."""
    elastic: bool = False
    """Whether its device groups may be elastic (the actor's batch follows the group's size)."""
    routing_replay: bool = False
    """Whether its actor may replay the rollout's expert routing (`actor.moe.routing_replay`)."""
    command: Callable[..., str] | None = None
    """Runs it: `command(cfg, plan, output_dir, args) -> the result line` (`xray/train.py`)."""
    algorithm: Callable[["RunConfig"], Any] | None = None
    """An RL command's algorithm object for a config (`xray/run/algorithm.py`); None for the jobs."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"JobSpec {self.name!r}: kind {self.kind!r} is none of {', '.join(KINDS)}")
        if (self.kind == "rl") != (self.algorithm is not None):
            raise ValueError(f"JobSpec {self.name!r}: an rl spec has an algorithm, and only an rl spec")
