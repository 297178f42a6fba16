"""Environments: what a model acts on over several turns, and the guard every call goes through.

An environment is a class with two async methods (gymnasium's shape, with text for actions):

    async def reset(self, row: dict) -> Observation
    async def step(self, action: str) -> tuple[Observation, float, bool, dict]

`reset` starts an episode from a data row (its prompt and columns) and returns the first
observation; `step` takes the model's turn (its decoded text) and returns the next observation,
the turn's reward, whether the episode is done, and an info dict. An observation is text, token ids
(appended as they are: the environment writes any markup) or a `ChatObservation` (text that is also
chat messages: a tool's answers as `role: tool` messages). Where the run uses a chat template
(`data.chat_template`), the runner closes the model's turn and renders the observation as the
template renders those messages (text: one user message), then the generation prompt
(`xray/data/chat_delta.py`); without one it appends the text tokenized alone. An environment with
tools gives their schemas (`tool_schemas`): the prompt is rendered with them. One instance serves
one episode at a time; the rollout makes one per episode.

`Guarded` runs each call under a timeout: an exception or a timeout ends that episode (never the
run) with a recorded reason (`EpisodeEnd`: `error` or `timeout`, with the error's text), counted
in the run's metrics. Environments are named like reward functions: `builtin:NAME` (`BUILTIN`) or
`path/to/file.py:ClassName` / `module:ClassName` (`load_env`); a class is built with the keyword
arguments of `env.kwargs` in the config.

Built in: `ToolEnv` (`builtin:tools`), where each turn's tool calls are answered by the registry's
tools (`xray/env/tools.py`) and an episode ends at the first turn without a call, scored by a reward
function on that final turn; `GuessEnv` (`builtin:guess`), a number to find with higher/lower
answers, rewarded when found; and `builtin:calculator`, arithmetic answered with the calculator
tool in the compact call format (`xray/env/tasks.py`).
"""
from __future__ import annotations

import asyncio
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Union


class ChatObservation(str):
    """An observation that is text (what a run without a chat template appends) and chat messages
    (`messages`, rendered by the template where the run has one)."""

    messages: tuple[dict, ...]

    def __new__(cls, text: str, messages) -> "ChatObservation":
        self = super().__new__(cls, text)
        self.messages = tuple(dict(m) for m in messages)
        return self

    def __reduce__(self):
        return ChatObservation, (str(self), self.messages)


Observation = Union[str, list[int], ChatObservation]


class EnvError(ValueError):
    """An environment named wrong, or one that breaks the interface: says what to fix."""


@dataclass(frozen=True)
class EpisodeEnd:
    """Why an episode ended early: `error` (the environment raised) or `timeout` (a call took longer
    than the guard allows), with the error's text."""

    reason: str
    detail: str = ""


@dataclass
class Guarded:
    """An environment's calls under a timeout (seconds per call); a failure becomes an `EpisodeEnd`."""

    env: Any
    timeout_s: float = 30.0

    async def reset(self, row: dict) -> Observation | EpisodeEnd:
        return await self._call("reset", row)

    async def step(self, action: str) -> tuple[Observation, float, bool, dict] | EpisodeEnd:
        out = await self._call("step", action)
        if isinstance(out, EpisodeEnd):
            return out
        if not (isinstance(out, tuple) and len(out) == 4):
            return EpisodeEnd("error", f"{type(self.env).__name__}.step returned {type(out).__name__}, "
                                       "not (observation, reward, done, info)")
        return out

    async def _call(self, method: str, arg: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self.env, method)(arg), self.timeout_s)
        except asyncio.TimeoutError:
            return EpisodeEnd("timeout", f"{type(self.env).__name__}.{method} took more than {self.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - the episode ends, the run goes on
            return EpisodeEnd("error", f"{type(self.env).__name__}.{method}: {type(exc).__name__}: {exc}")


@dataclass
class ToolEnv:
    """Tool use: the prompt is the first observation; each turn's calls are answered (`ToolFormat`:
    its response tags without a chat template, `role: tool` messages with one), and the first turn
    without one ends the episode, scored by `reward(row, final_text)`.

    From a config (`env.name: builtin:tools`, these in `env.kwargs`): `tools` a list of tool specs
    (`builtin:calculator`, `builtin:python`, `path/to/tools.py:lookup`), `reward` a reward
    function's spec (`xray.rewards.builtin:exact_answer`: called as a run calls it, with the
    prompt, the final turn's text and the row's other columns; `async def` too), `format` a tool-call
    style (`hermes`, `compact`) or a dict of `ToolFormat` fields, `tool_timeout_s` each call's bound; the
    run's `env.sandbox` section says where `builtin:python` runs."""

    tools: Any
    """A `ToolRegistry`, or a list of tool specs."""
    reward: Any
    """`reward(row, final_text) -> float` (or awaitable), or a reward function's spec."""
    format: Any = None
    """A `ToolFormat` (Hermes' by default), a style name, or a dict of its fields."""
    tool_timeout_s: float = 30.0
    """Each tool call's bound, when `tools` are specs."""
    sandbox: Any = None
    """Where `builtin:python` runs, when `tools` are specs: a `SandboxConfig` (a run passes its
    `env.sandbox`); None: the local sandbox with its default limits."""
    row: dict = field(default_factory=dict)
    calls: int = 0
    """Tool calls made in this episode (the run's metrics count them)."""

    def __post_init__(self) -> None:
        from xray.env.tools import ToolFormat, ToolRegistry

        if isinstance(self.tools, (list, tuple)):
            self.tools = ToolRegistry.from_specs(list(self.tools), self.tool_timeout_s, self.sandbox)
        if isinstance(self.reward, str):
            self.reward = _final_turn_reward(self.reward)
        if isinstance(self.format, str):
            self.format = ToolFormat(style=self.format)
        elif isinstance(self.format, dict):
            self.format = ToolFormat(**self.format)

    @property
    def tool_schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas, for the prompt (`ToolRegistry.schemas`)."""
        schemas = getattr(self.tools, "schemas", None)
        return schemas() if callable(schemas) else []

    @property
    def stop(self) -> tuple[str, ...]:
        """Where a model turn ends (`xray/run/episodes/runner.py`): a call's closing tag, so that the tool
        answers before the model writes on."""
        from xray.env.tools import ToolFormat

        return ((self.format or ToolFormat()).call_close,)

    async def reset(self, row: dict) -> Observation:
        from xray.env.tools import ToolFormat

        self.format = self.format or ToolFormat()
        self.row, self.calls = row, 0
        return row["prompt"]

    async def step(self, action: str) -> tuple[Observation, float, bool, dict]:
        calls = self.format.calls(action)
        if not calls:
            score = self.reward(self.row, action)
            if inspect.isawaitable(score):
                score = await score
            return "", float(score), True, {"tool_calls": self.calls}
        answers = await asyncio.gather(*[self.tools.call(c) for c in calls])
        self.calls += len(calls)
        messages = [dict({"role": "tool", "content": a}, **({"name": c.name} if not isinstance(c, str) else {}))
                    for c, a in zip(calls, answers)]
        text = "".join(self.format.response(a) for a in answers)
        return ChatObservation(text, messages), 0.0, False, {"tool_calls": self.calls}


@dataclass
class GuessEnv:
    """Find a whole number in [low, high] (the row's `secret`): each turn's last number is a guess,
    answered `higher`, `lower` or `correct` (reward 1, done); a turn without a number is told so."""

    low: int = 1
    high: int = 100
    secret: int = 0
    guesses: int = 0

    async def reset(self, row: dict) -> Observation:
        self.secret, self.guesses = int(row["secret"]), 0
        return row.get("prompt") or f"Guess my number between {self.low} and {self.high}."

    async def step(self, action: str) -> tuple[Observation, float, bool, dict]:
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return " No number in your guess; answer with a number.\n", 0.0, False, {"guesses": self.guesses}
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.secret:
            return "", 1.0, True, {"guesses": self.guesses}
        return f" {'higher' if guess < self.secret else 'lower'}\n", 0.0, False, {"guesses": self.guesses}


def _final_turn_reward(spec: str) -> Callable[[dict, str], Any]:
    """A reward function (`prompts, completions, **columns -> scores`, `xray/rewards`) named by
    `spec`, as `ToolEnv`'s `reward(row, final_text)` (awaitable when the function is `async def`)."""
    from xray.rewards.loader import RewardSpecError, load_reward_function

    try:
        fn = load_reward_function(spec)
    except RewardSpecError as exc:
        raise EnvError(f"builtin:tools reward: {exc}") from None

    def call(row: dict, text: str):
        columns = {k: [v] for k, v in row.items() if k not in ("prompt", "prompt_ids")}
        out = fn([row.get("prompt", "")], [text], **columns)
        if inspect.isawaitable(out):
            async def first():
                return (await out)[0]
            return first()
        return out[0]
    return call


BUILTIN: dict[str, type | str] = {"tools": ToolEnv, "guess": GuessEnv, "calculator": "xray.env.tasks:CalculatorEnv"}
"""Built-in environments: a class, or `module:Class` imported on first use (a task built on these)."""


def load_env(spec: str) -> type:
    """The environment class named by `spec`: `builtin:NAME`, `module:Class` or `path/to/file.py:Class`;
    it must have async `reset` and `step`."""
    from xray.rewards.loader import RewardSpecError, load_callable

    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN:
            raise EnvError(f"unknown built-in environment {spec!r}; choose one of "
                           f"{', '.join('builtin:' + n for n in sorted(BUILTIN))}")
        found = BUILTIN[name]
        if isinstance(found, str):
            import importlib

            module, attr = found.split(":")
            found = getattr(importlib.import_module(module), attr)
        return found
    try:
        cls = load_callable(spec, "environment", "path/to/env.py:MyEnv")
    except RewardSpecError as exc:
        raise EnvError(str(exc)) from None
    missing = [m for m in ("reset", "step") if not inspect.iscoroutinefunction(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"environment {spec!r} needs async methods reset(row) and step(action); "
                       f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing or not async")
    return cls
