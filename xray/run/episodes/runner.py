"""Multi-turn episodes on a rollout engine: many in flight, the engine's turns batched while others wait.

`EpisodeRunner.run(rows)` plays one episode per row against an environment (`xray/env/base.py`,
each call guarded by a timeout) and returns token-exact trajectories (`xray/data/trajectory.py`):
- every trajectory ready for a model turn joins the next `generate` call on the rollout WholeModel
  (one call for all of them: the engine batches them, and its prefix cache serves the history a
  turn shares with the one before);
- the turn's tokens and log-probs are appended as the engine produced them, its text (decoded
  once) goes to the environment's `step`, as a task of its own: while one episode waits on its
  tool or judge, the engine generates for the others;
- the observation is tokenized alone (text) or taken as ids, and appended; the episode ends when
  the environment says done, at a limit (`TrajectoryLimits`), or on the environment's failure
  (`EpisodeEnd`: recorded, counted, never the run's end).
`rollout` is a WholeModel, or anything with its `generate` (an asynchronous run's maker batches
the turns of its episodes across runs and reports the weight version of each call,
`xray/run/detached/episode_maker.py`). A turn stops at the engine's stop tokens (the tokenizer's end-of-sequence: pass them in
`sampling["stop_token_ids"]`), and at the first of the environment's `stop` strings (a tool call's
closing tag, say), whatever the engine: the turn keeps its tokens up to the one that completes it
(those after it are dropped, with their log-probs; sampling is causal, so the kept ones are exactly
what the engine sampled).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from xray.data.stops import stop_string_end
from xray.data.trajectory import Trajectory, TrajectoryLimits
from xray.env.base import EpisodeEnd, Guarded


class EpisodeRunner:
    """Plays episodes of one environment class on one rollout model (see the module docstring)."""

    def __init__(self, rollout: Any, tokenizer: Any, make_env: Callable[[], Any], limits: TrajectoryLimits,
                 sampling: dict, env_timeout_s: float = 30.0):
        self.rollout, self.tokenizer, self.make_env = rollout, tokenizer, make_env
        self.limits, self.sampling, self.env_timeout_s = limits, dict(sampling), env_timeout_s
        self.calls = 0
        self.stats: collections.Counter = collections.Counter()
        """Counts over the runs: `turns`, `generate_calls`, `ends/<reason>`, `env_wait_s`."""

    def ids(self, observation: Any) -> list[int]:
        """An observation's token ids: text tokenized alone (no special tokens added), ids as given."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False).input_ids) if observation else []
        return [int(t) for t in observation]

    async def run(self, rows: list[dict]) -> list[Trajectory]:
        """One trajectory per row, in order."""
        envs = [Guarded(self.make_env(), self.env_timeout_s) for _ in rows]
        firsts = await asyncio.gather(*[env.reset(row) for env, row in zip(envs, rows)])
        trajectories, ready = [], []
        for i, (row, first) in enumerate(zip(rows, firsts)):
            if isinstance(first, EpisodeEnd):
                t = Trajectory(prompt_ids=list(row.get("prompt_ids") or []))
                self._finish(t, first.reason, first.detail)
            else:
                t = Trajectory(prompt_ids=list(row.get("prompt_ids") or self.ids(first)))
                ready.append(i)
            trajectories.append(t)
        waiting: dict[asyncio.Future, tuple[int, float]] = {}
        while ready or waiting:
            if ready:
                batch, ready = ready, []
                await self._turn([trajectories[i] for i in batch], batch, envs, waiting)
            if not waiting:
                continue
            done, _ = await asyncio.wait(list(waiting), timeout=0 if ready else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, started = waiting.pop(task)
                self.stats["env_wait_s"] += time.perf_counter() - started
                if self._observe(trajectories[i], task.result()):
                    ready.append(i)
        return trajectories

    async def _turn(self, batch: list[Trajectory], indices: list[int], envs: list[Guarded],
                    waiting: dict[asyncio.Future, tuple[int, float]]) -> None:
        """One model turn for each trajectory of `batch` (one engine call); each turn's text goes to
        its environment's `step`, as a task."""
        from xray.backends.sampling import RESPONSE_LOGPROBS, WEIGHT_VERSION
        from xray.data import columns as C

        rooms = [t.room(self.limits) for t in batch]
        self.calls += 1
        sampling = dict(self.sampling, n=1, max_new_tokens=max(rooms),
                        seed=self.sampling.get("seed", 0) * 1_000_003 + self.calls)
        prompts = [t.ids for t in batch]
        dp = getattr(getattr(self.rollout, "parallel", None), "dp", 1)  # every replica takes an equal part:
        prompts += [prompts[0]] * (-len(prompts) % dp)  # copies of the first fill the last (answers dropped)
        out = await self.rollout.generate(prompts, sampling)
        version = int(out.get(WEIGHT_VERSION, 0)) if isinstance(out, dict) else 0
        self.stats["generate_calls"] += 1
        for t, i, room, ids, logprobs in zip(batch, indices, rooms, out[C.RESPONSE_IDS], out[RESPONSE_LOGPROBS]):
            keep = self.cut(ids[:room], getattr(envs[i].env, "stop", ()))
            ids, logprobs = [int(x) for x in ids[:keep]], [float(x) for x in logprobs[:keep]]
            t.add_turn(ids, logprobs, version)
            self.stats["turns"] += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            waiting[asyncio.ensure_future(envs[i].step(text))] = (i, time.perf_counter())

    def cut(self, ids: list[int], stops) -> int:
        """How many of a turn's tokens it keeps: up to the token that completes the first of the
        `stops` strings in its text (`xray.data.stops.stop_string_end`, the rollout engines' rule);
        all of them when none occurs."""
        end = stop_string_end(lambda part: self.tokenizer.decode(part, skip_special_tokens=True), ids, stops or ())
        return len(ids) if end is None else end

    def _observe(self, t: Trajectory, result: Any) -> bool:
        """The environment's answer to the last turn; whether the episode goes on."""
        if isinstance(result, EpisodeEnd):
            self._finish(t, result.reason, result.detail)
            return False
        observation, reward, done, info = result
        t.rewards.append(float(reward))
        t.info = dict(info or {})
        if done:
            self._finish(t, "done")
            return False
        ids = self.ids(observation)
        if len(t.tokens) + len(ids) >= self.limits.max_tokens:
            self._finish(t, "max_tokens")
            return False
        t.add_observation(ids)
        if t.room(self.limits) == 0:
            self._finish(t, "max_turns" if len(t.turns) >= self.limits.max_turns else "max_tokens")
            return False
        return True

    def _finish(self, t: Trajectory, end: str, detail: str = "") -> None:
        t.finish(end, detail)
        self.stats[f"ends/{end}"] += 1
