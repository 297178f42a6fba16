"""The `env` section of a run config: multi-turn episodes instead of single completions.

Sits in the config layer. With `env.name` set, every rollout of a PPO, GRPO, RLOO or REINFORCE++
step is an episode against that environment (`xray/env/base.py`), played by the episode runner
(`xray/run/episodes/runner.py`) on the rollout engine: the model's turns and the environment's
observations make one token-exact trajectory, trained on the model's tokens only, scored by the
environment's rewards (summed) instead of `reward.function`. Unset: one completion per sample,
as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from xray.config.sandbox import SandboxConfig


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes against an environment (tools, games, judges)."""

    name: Optional[str] = None
    """The environment: `builtin:calculator`, `builtin:guess`, `builtin:tools`, or a class as
    `path/to/env.py:MyEnv` / `module:MyEnv` with async `reset(row)` and `step(action)`, scoring
    the episodes with its rewards (the `reward` section is not read); null: one completion per
    sample, scored by `reward`."""
    agent: Optional[str] = None
    """Instead of `name`: your agent code, `path/to/agent.py:run` or `module:run`, a function
    `run(row, base_url) -> reward` (or `async def`) that talks to the run's OpenAI-compatible
    endpoint (`trainer.agent_endpoint`) at `base_url` with the `openai` client, once per sample;
    its session's tokens are the sample, its return the reward."""
    tool_parser: str = "hermes"
    """How the agent endpoint finds tool calls in the model's answers to return them as OpenAI
    `tool_calls` (`env.agent` only): `hermes` (or `qwen`: `<tool_call>{json}</tool_call>`, the format
    of Hermes, Qwen2.5 and Qwen3 templates), or a name registered with
    `xray.run.episodes.tool_calls.register_tool_parser`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the environment class is built with (one instance per episode);
    `builtin:tools` takes `tools` (tool specs), `reward` (a reward function's spec), `format`
    (`hermes`, `compact`) and `tool_timeout_s`."""
    max_turns: int = 4
    """Model turns per episode at most."""
    max_turn_tokens: int = 32
    """Tokens one model turn may generate (the rollout's `max_new_tokens` does not apply)."""
    max_tokens: int = 128
    """Tokens after the prompt per episode at most, the model's and the observations'; the
    rollout engine's context is sized for the prompt and these."""
    timeout_s: float = 30.0
    """Seconds each `reset` or `step` may take; beyond, or on an exception, the episode ends
    (counted in `episode/ends_timeout`, `episode/ends_error`) and is left out of the loss."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where the `builtin:python` tool runs the model's programs (an environment taking a `sandbox`
    argument, as `builtin:tools`, gets this section): locally in Linux namespaces, or on a remote
    service (`url`); and the limits of one call."""

    @property
    def episodes(self) -> bool:
        """Whether a run's samples are episodes (an environment's or an agent's)."""
        return bool(self.name or self.agent)

    def check(self) -> None:
        """Raise ValueError on settings that cannot work, saying the fix."""
        if self.name and self.agent:
            raise ValueError("env.name and env.agent are both set; an episode is played by an environment or by "
                             "your agent code: unset one")
        for name in ("max_turns", "max_turn_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"env.{name}={getattr(self, name)}; give 1 or more")
        if self.max_turn_tokens > self.max_tokens:
            raise ValueError(f"env.max_turn_tokens={self.max_turn_tokens} exceeds env.max_tokens={self.max_tokens}; "
                             "raise env.max_tokens or lower env.max_turn_tokens")
        if self.timeout_s <= 0:
            raise ValueError(f"env.timeout_s={self.timeout_s}; give a positive number of seconds")
        self.sandbox.check()


def response_tokens(cfg: Any) -> int:
    """Tokens a run's rollout writes after a prompt at most (a `RunConfig`): a whole episode's
    (`env.max_tokens`) with an environment, else one completion's (`rollout.max_new_tokens`)."""
    return cfg.env.max_tokens if cfg.env.episodes else cfg.rollout.max_new_tokens
