"""An experience maker's episodes: with `env.name` in an asynchronous run, each maker plays the
prompts it leases as multi-turn episodes on its own rollout replica.

Sits beside the maker's single-turn loop (`xray/run/detached/maker.py`, which builds it and whose
buffer, reference, engine lock and weight loads it uses) over the run machinery's episode runner
(`xray/run/episodes/runner.py`):
- each lease's samples (`rollout.n_samples` episodes per prompt) are played as a task of their
  own, and new prompts are leased as soon as slots of `async.max_in_flight` free: many episodes in
  flight, whatever their lengths;
- their turns share the engine (`TurnBatcher`): the turns ready within `FLUSH_S` of each other, of
  any lease, go in one `generate` call under the maker's engine lock, so a weight load
  (`ExperienceMaker.load`) comes between two calls, never inside one; each turn records the
  version that sampled it (BEHAVIOUR_VERSIONS per token, used by the decoupled loss as a partial
  rollout's are) and the engine's log-probs;
- a lease whose episodes have all ended gets the reference's log-probs (by reference), SCORES its
  episodes' returns, the episodes that ended on their environment's failure out of the loss, and
  goes into the buffer as one object: nothing passes through the driver;
- after a rollback an episode is not cut (its environment cannot go back): the buffer makes again
  every group with tokens of discarded weights (`ExperienceBuffer.discarded`).
The episodes' counts since the trainer last asked (`take_counts`) become its step's `episode/*`
metrics (`episode_metrics`): the episodes that ended during the step, of every maker.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any

import torch

from xray.data import columns as C

FLUSH_S = 0.005
"""Turns ready within this many seconds of each other share one generate call."""


class _OneReplica:
    dp = 1
    """The runner pads nothing: `TurnBatcher` pads the call it makes."""


class TurnBatcher:
    """The maker's engine as its episode runner sees it: `generate` queues a turn's prompts, and
    the turns queued while the engine works, or within `FLUSH_S`, go in one call."""

    parallel = _OneReplica()

    def __init__(self, maker: Any):
        self.maker = maker
        self.queue: list[tuple[list, dict, asyncio.Future]] = []
        self.flushing: asyncio.Future | None = None
        self.calls = 0

    async def generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        future = asyncio.get_running_loop().create_future()
        self.queue.append((prompts, sampling, future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        while self.queue:
            await asyncio.sleep(FLUSH_S)
            batch, self.queue = self.queue, []
            try:
                outs = await self._call(batch)
            except BaseException as exc:  # every turn of the call fails with it (the maker stops)
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, _, future), out in zip(batch, outs):
                if not future.done():
                    future.set_result(out)

    async def _call(self, batch: list[tuple[list, dict, asyncio.Future]]) -> list[dict]:
        """One generate call for the queued turns (padded with copies of the first prompt to a
        multiple of the replica's dp), under the engine lock; each turn's part of the answer, with
        the weight version that produced it."""
        from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS, WEIGHT_VERSION

        m = self.maker
        prompts = [p for ps, _, _ in batch for p in ps]
        prompts += [prompts[0]] * (-len(prompts) % m.rollout.parallel.dp)
        self.calls += 1
        sampling = dict(batch[0][1], max_new_tokens=max(s["max_new_tokens"] for _, s, _ in batch),
                        seed=1_000_003 * (m.index + 1) + self.calls)
        out, version = await m.generate(prompts, sampling)
        m.segments += 1
        parts, first = [], 0
        for ps, _, _ in batch:
            part = {k: list(out[k][first:first + len(ps)]) for k in (C.RESPONSE_IDS, RESPONSE_LOGPROBS, FINISH_REASON)}
            parts.append({**part, WEIGHT_VERSION: version})
            first += len(ps)
        return parts


class EpisodeMaking:
    """The episode loop of one maker (see the module docstring)."""

    def __init__(self, maker: Any, tokenizer: Any):
        from xray.run.episodes.samples import env_factory
        from xray.run.phases import rollout_sampling
        from xray.data.trajectory import TrajectoryLimits
        from xray.run.episodes.runner import EpisodeRunner

        self.maker = maker
        e = maker.cfg.env
        limits = TrajectoryLimits(max_turns=e.max_turns, max_turn_tokens=e.max_turn_tokens, max_tokens=e.max_tokens)
        sampling = dict(rollout_sampling(maker.cfg, maker.stop_ids, maker.index + 1), n=1)
        self.runner = EpisodeRunner(TurnBatcher(maker), tokenizer, env_factory(maker.cfg), limits, sampling,
                                    e.timeout_s)
        self.counts: collections.Counter = collections.Counter()

    async def loop(self) -> None:
        """Lease while slots are free, play each lease as a task; an episode task's error (never an
        environment's: those end their episode) stops the loop."""
        m = self.maker
        tasks: set[asyncio.Future] = set()
        lease: asyncio.Future | None = None
        try:
            while True:
                free = m.max_in_flight - m.in_flight
                if lease is None and free > 0:
                    lease = asyncio.ensure_future(m.buffer.lease.remote(m.index, free, m.version))
                done, _ = await asyncio.wait([*tasks, *([lease] if lease else [])],
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is lease:
                        leased, lease = task.result(), None
                        if leased:
                            m.in_flight += len(leased)
                            tasks.add(asyncio.ensure_future(self.play(leased)))
                    else:
                        tasks.discard(task)
                        task.result()
        finally:
            for task in [*tasks, *([lease] if lease else [])]:
                task.cancel()

    async def play(self, leased: list[tuple[int, dict]]) -> None:
        """The leased prompts' episodes, scored and put into the buffer."""
        from xray.run.episodes.samples import FAILED
        from xray.run.detached.sample import Sample
        from xray.data.trajectory import pack_trajectories

        m, n = self.maker, self.maker.cfg.rollout.n_samples
        epoch = m.epoch
        trajectories = await self.runner.run([row for _, row in leased for _ in range(n)])
        batch = pack_trajectories(trajectories, m.pad_id, versions=True)
        keep = torch.tensor([t.end not in FAILED for t in trajectories])
        samples = [Sample(key, row, list(t.tokens), list(t.logprobs),
                          [v for v, model in zip(t.versions, t.mask) if model], True, epoch)
                   for (key, row), t in zip([x for x in leased for _ in range(n)], trajectories)]
        ref = m._reference(batch)
        self._count(trajectories)
        groups = [samples[i * n:(i + 1) * n] for i in range(len(leased))]
        await m._put(batch, await ref, groups, batch[C.SCORES], keep, range(len(groups)))

    def _count(self, trajectories: list) -> None:
        c = self.counts
        for t in trajectories:
            calls = int(t.info.get("tool_calls", 0))
            c["episodes"] += 1
            c["turns"] += len(t.turns)
            c["tool_calls"] += calls
            c["tool_episodes"] += calls > 0
            c[f"ends_{t.end}"] += 1

    def take_counts(self) -> dict[str, float]:
        """The counts since the last call (and the runner's environment wait and generate calls)."""
        stats = self.runner.stats
        out = {**{k: float(v) for k, v in self.counts.items()}, "env_wait_s": float(stats["env_wait_s"]),
               "generate_calls": float(stats["generate_calls"])}
        self.counts = collections.Counter()
        stats["env_wait_s"], stats["generate_calls"] = 0.0, 0
        return out


def episode_metrics(counts: list[dict[str, float]]) -> dict[str, float]:
    """A step's `episode/*` metrics from its makers' counts (`EpisodeMaking.take_counts`); none
    when no episode ended during the step."""
    total: collections.Counter = collections.Counter()
    for c in counts:
        total.update(c)
    n = total.get("episodes", 0.0)
    if not n:
        return {}
    out = {"episode/turns": total["turns"] / n, "episode/tool_calls": total["tool_calls"] / n,
           "episode/tool_call_share": total["tool_episodes"] / n, "episode/env_wait_s": total["env_wait_s"],
           "episode/generate_calls": total["generate_calls"], "episode/episodes": n}
    out.update({f"episode/{k}": v for k, v in sorted(total.items()) if k.startswith("ends_")})
    return out
