"""A step's samples as episodes of the user's own agent code, through the OpenAI-compatible endpoint.

Sits beside `xray/run/episodes/samples.py` (environments xray drives) for agents that drive
themselves: with `env.agent` set (`path/to/agent.py:function` or `module:function`), each of a
step's samples is one call of that function, `agent(row, base_url) -> reward`, sync or
`async def`, which talks to the run's endpoint (`trainer.agent_endpoint`, `xray/run/episodes/endpoint.py`)
with the `openai` client at `base_url`, a session of its own, and returns the episode's reward.
The session's token-exact trajectory, with that reward, is the sample; from there the step is the
single-turn one. A synchronous agent runs in threads of the play's own, as many as its episodes
(`xray/run/episodes/agent_threads.py`), its `env.timeout_s` counted from when it starts running.
An agent that raises or overruns `env.timeout_s` ends its episode as `error` or
`timeout`, left out of the loss; the run goes on. One that raises after the endpoint refused a
request at a limit (`env.max_turns`, `env.max_tokens`) ends it there: reward 0, trained on, as an
environment's episode cut at a limit.
"""
from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from typing import Any

from xray.run.episodes.agent_threads import AgentThreads
from xray.run.episodes.samples import FAILED, EpisodeSamples
from xray.data.batch import Batch
from xray.data.chat import ChatFormat
from xray.data.trajectory import Trajectory, TrajectoryLimits, pack_trajectories
from xray.run.episodes.endpoint import AgentEndpoint

log = logging.getLogger(__name__)


def endpoint_address(spec: str) -> tuple[str, int]:
    """`host:port` of `trainer.agent_endpoint` (port 0: any free one)."""
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"trainer.agent_endpoint={spec!r}; give host:port, e.g. 127.0.0.1:8000 (port 0: any free one)")
    return host, int(port)


class AgentSamples(EpisodeSamples):
    """Plays a step's episodes with the user's agent function (see the module docstring)."""

    def __init__(self, cfg: Any, rollout: Any, tokenizer: Any, pad_id: int):
        from xray.rewards.loader import load_callable

        e = cfg.env
        self.agent = load_callable(e.agent, "agent", "path/to/agent.py:run")
        self.timeout_s, self.pad_id = e.timeout_s, pad_id
        host, port = endpoint_address(cfg.trainer.agent_endpoint)
        limits = TrajectoryLimits(max_turns=e.max_turns, max_turn_tokens=e.max_turn_tokens, max_tokens=e.max_tokens)
        self.endpoint = AgentEndpoint(rollout, tokenizer, limits, {}, host, port, chat=ChatFormat.of(cfg.data),
                                      tool_parser_name=e.tool_parser)
        self.keep, self.last, self.metrics = None, [], {}

    async def play(self, rows: list[dict], sampling: dict) -> Batch:
        """One agent episode per sample: each row `sampling["n"]` times, in order; their batch."""
        if self.endpoint.runner is None or self.endpoint.loop is not asyncio.get_running_loop():
            await self.endpoint.start()  # first, or on a new event loop (the old one's server went with it)
        n = int(sampling.get("n", 1))
        self.endpoint.sampling = dict(sampling, n=1)
        calls = self.endpoint.calls
        threads = None if inspect.iscoroutinefunction(self.agent) else AgentThreads(len(rows) * n)
        try:
            trajectories = await asyncio.gather(*[self._episode(row, threads) for row in rows for _ in range(n)])
        finally:
            if threads is not None:
                threads.close()
        exp = pack_trajectories(trajectories, self.pad_id)
        self._keep(trajectories)
        stats = collections.Counter({"generate_calls": self.endpoint.calls - calls})
        self.metrics = self._metrics(trajectories, stats)
        return exp

    def _keep(self, trajectories: list[Trajectory]) -> None:
        import torch

        failed = torch.tensor([t.end in FAILED or not t.tokens for t in trajectories])
        self.keep = ~failed if bool(failed.any()) else None
        if self.keep is not None:
            first = next((t for t in trajectories if t.end in FAILED), None)
            log.warning("%d of %d agent episodes failed or never asked the endpoint (left out of the loss)%s",
                        int(failed.sum()), len(trajectories), f"; the first: {first.detail}" if first else "")
        self.last = trajectories

    async def _episode(self, row: dict, threads: AgentThreads | None) -> Trajectory:
        """One agent call (`threads`: where a synchronous agent runs; None: an `async def` one)."""
        sid, base_url = self.endpoint.open()
        end, detail, reward = "done", "", 0.0
        try:
            if threads is None:
                reward = float(await asyncio.wait_for(self.agent(row, base_url), self.timeout_s))
            else:
                reward = float(await threads.call(self.agent, self.timeout_s, row, base_url))
        except asyncio.TimeoutError:
            end, detail = "timeout", f"the agent took more than {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - this episode ends, the run goes on
            end, detail = "error", f"{type(exc).__name__}: {exc}"
        t, limit = self.endpoint.close(sid)
        if limit and end == "error":  # refused at a limit, it stopped: a truncated episode, trained on
            end, detail = limit, ""
        t.rewards.append(reward)
        t.finish(end, detail)
        return t

    async def close(self) -> None:
        await self.endpoint.stop()
