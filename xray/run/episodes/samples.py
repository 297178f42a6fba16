"""A step's samples as multi-turn episodes: the run's environment (`env`) played on the rollout.

Sits between the run machinery's episode runner (`xray/run/episodes/runner.py`) and the synchronous
step of every RL algorithm (`xray/run/step.py`). With
`env.name` set, each of a step's `rollout_batch_size x n_samples` samples is one episode: the
runner plays them all at once on the rollout WholeModel, and their token-exact trajectories are
laid out as the step's batch (`pack_trajectories`: the prompt, then the model's turns and the
observations; LOSS_MASK 1 on the model's tokens only; BEHAVIOUR_LOGPROBS the engine's). From there
the step is the single-turn one: the actor's, reference's and critic's forwards, advantages (a
sample's score is its episode's rewards summed), the update, the verified sync.

An episode that ended on its environment's failure (`error`, `timeout`) is left out of the loss
(as a non-finite reward with `reward.on_nonfinite: skip`), so a broken tool does not teach the
model anything. Metrics, per step: `episode/turns`, `episode/tool_calls`, `episode/tool_call_share`
(the share of episodes that called a tool), `episode/env_wait_s`, `episode/ends_<reason>`.
"""
from __future__ import annotations

import collections
import inspect
import logging
from typing import Any

import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.chat import ChatFormat
from xray.data.trajectory import Trajectory, TrajectoryLimits, pack_trajectories
from xray.env.base import EnvError, load_env
from xray.run.episodes.runner import EpisodeRunner

log = logging.getLogger(__name__)
FAILED = ("error", "timeout")
"""Ends that leave an episode out of the loss."""


def env_factory(cfg: Any):
    """A function making one environment of `cfg.env` (checked now: a class that cannot be built
    from `env.kwargs` fails here, saying so, not at the first step). An environment that takes a
    `sandbox` argument (`ToolEnv`) gets `env.sandbox` unless `env.kwargs` gives one."""
    cls, kwargs = load_env(cfg.env.name), dict(cfg.env.kwargs)
    if "sandbox" in inspect.signature(cls).parameters:
        kwargs.setdefault("sandbox", cfg.env.sandbox)
    try:
        cls(**kwargs)
    except TypeError as exc:
        raise EnvError(f"env.name={cfg.env.name!r} cannot be built with env.kwargs={kwargs}: {exc}; "
                       "give the keyword arguments its constructor takes in env.kwargs") from None
    return lambda: cls(**kwargs)


class EpisodeSamples:
    """Plays a step's episodes and lays them out for training (see the module docstring)."""

    def __init__(self, cfg: Any, rollout: Any, tokenizer: Any, pad_id: int):
        e = cfg.env
        limits = TrajectoryLimits(max_turns=e.max_turns, max_turn_tokens=e.max_turn_tokens, max_tokens=e.max_tokens)
        self.runner = EpisodeRunner(rollout, tokenizer, env_factory(cfg), limits, {}, e.timeout_s,
                                    chat=ChatFormat.of(cfg.data))
        self.pad_id = pad_id
        self.keep: torch.Tensor | None = None
        """Per sample of the last `play`: whether it enters the loss (None: all)."""
        self.last: list[Trajectory] = []
        self.metrics: dict[str, float] = {}
        """Those of the last `play` (module docstring)."""

    async def play(self, rows: list[dict], sampling: dict) -> Batch:
        """One episode per sample: each row `sampling["n"]` times, in order (a prompt's samples
        side by side, as the engine returns them); their batch, with SCORES the episodes' returns."""
        n = int(sampling.get("n", 1))
        before = collections.Counter(self.runner.stats)
        self.runner.sampling = dict(sampling, n=1)
        trajectories = await self.runner.run([row for row in rows for _ in range(n)])
        exp = pack_trajectories(trajectories, self.pad_id)
        failed = torch.tensor([t.end in FAILED for t in trajectories])
        self.keep = ~failed if bool(failed.any()) else None
        if self.keep is not None:
            log.warning("%d of %d episodes ended on their environment's failure (left out of the loss); the first: %s",
                        int(failed.sum()), len(trajectories), next(t.detail for t in trajectories if t.end in FAILED))
        self.last = trajectories
        self.metrics = self._metrics(trajectories, collections.Counter(self.runner.stats) - before)
        return exp

    @staticmethod
    def _metrics(trajectories: list[Trajectory], stats: collections.Counter) -> dict[str, float]:
        calls = [float(t.info.get("tool_calls", 0)) for t in trajectories]
        out = {"episode/turns": sum(len(t.turns) for t in trajectories) / len(trajectories),
               "episode/tool_calls": sum(calls) / len(trajectories),
               "episode/tool_call_share": sum(c > 0 for c in calls) / len(trajectories),
               "episode/env_wait_s": float(stats.get("env_wait_s", 0.0)),
               "episode/generate_calls": float(stats.get("generate_calls", 0))}
        ends = collections.Counter(t.end for t in trajectories)
        out.update({f"episode/ends_{end}": float(count) for end, count in sorted(ends.items())})
        return out

    async def close(self) -> None:
        """Nothing to release (an agent's endpoint is: `AgentSamples.close`)."""

    def scores(self, exp: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last play's scores (its episodes' returns) and which samples enter the loss."""
        return exp[C.SCORES], self.keep
