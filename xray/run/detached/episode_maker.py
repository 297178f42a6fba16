"""An experience maker's episodes: with `env.name` in an asynchronous run, each maker plays the
prompts it leases as multi-turn episodes on its own rollout replica.

Sits beside the maker's single-turn loop (`xray/run/detached/maker.py`, which builds it and whose
buffer, reference, engine lock and weight loads it uses) over the run machinery's episode runner
(`xray/run/episodes/runner.py`):
- each lease's samples (`rollout.n_samples` episodes per prompt) are played as a task of their
  own, and new prompts are leased as soon as slots of `async.max_in_flight` free (a group put
  frees its prompt's slot): many episodes in flight, whatever their lengths;
- their turns share the engine (`TurnBatcher`): the turns ready within `FLUSH_S` of each other, of
  any lease, go in one `generate` call under the maker's engine lock, so a weight load
  (`ExperienceMaker.load`) comes between two calls, never inside one. A turn is generated
  `async.segment_tokens` tokens at a time, as a plain maker's samples are (0: the whole turn in one
  call): between two segments a weight load may come, and the turn goes on from the tokens it has
  (exact ids, nothing re-tokenized) with the new weights, so a push waits at most one segment of
  each maker's turns; each token records the version that sampled it (BEHAVIOUR_VERSIONS, used
  by the decoupled loss) and the engine's log-prob. A turn's segments end at its stop (a stop
  token, or a stop string: one the engine saw, or one that straddles two segments, found on the
  turn's text) or at its token budget;
- a prompt whose episodes have all ended is put at once, without waiting for the rest of its
  lease (a slow tool in one episode holds back only its own group): the groups that end within
  `FLUSH_S` of each other get the reference's log-probs (by reference) in one forward, SCORES
  their episodes' returns, the episodes that ended on their environment's failure out of the loss,
  and go into the buffer as one object: nothing passes through the driver;
- after a rollback an episode is not cut (its environment cannot go back): the buffer makes again
  every group with tokens of discarded weights (`ExperienceBuffer.discarded`).
Each group carries its episodes' counts (turns, tool calls, how they ended) into the buffer, so
the trainer's `episode/*` metrics (`episode_metrics`) count the episodes it trained in the step,
whichever maker played them and whether or not that maker still lives; the makers' environment
wait and generate calls since the trainer last asked (`take_counts`) are added beside them.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any

import torch

from xray.data import columns as C

FLUSH_S = 0.005
"""Turns ready within this many seconds of each other share one generate call; groups ended
within it go into the buffer together."""


class _OneReplica:
    dp = 1
    """The runner pads nothing: `TurnBatcher` pads the call it makes."""


class TurnBatcher:
    """The maker's engine as its episode runner sees it: `generate` plays a turn in segments, each
    queued, and the segments queued while the engine works, or within `FLUSH_S`, go in one call."""

    parallel = _OneReplica()

    def __init__(self, maker: Any):
        self.maker = maker
        self.segment = int(getattr(maker.cfg.async_, "segment_tokens", 0) or 0)
        """Tokens of a turn per call (0: the whole turn)."""
        self.queue: list[tuple[list, dict, asyncio.Future]] = []
        self.flushing: asyncio.Future | None = None
        self.calls = 0

    async def generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        """A turn for each of `prompts`, up to `sampling["max_new_tokens"]` tokens, in segments (see
        the module docstring); per prompt its ids, log-probs, finish reason and each token's weight
        version (BEHAVIOUR_VERSIONS; WEIGHT_VERSION: the first segment's)."""
        from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS, WEIGHT_VERSION

        budget = int(sampling["max_new_tokens"])
        ids: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        reasons, going, first = ["length"] * len(prompts), list(range(len(prompts))), None
        while going:
            room = min(self.segment or budget, budget - len(ids[going[0]]))  # all going have as many
            out = await self._queued([list(prompts[i]) + ids[i] for i in going], dict(sampling, max_new_tokens=room))
            first = out[WEIGHT_VERSION] if first is None else first
            full = []
            for k, i in enumerate(going):
                got = out[C.RESPONSE_IDS][k]
                ids[i] += [int(t) for t in got[:room]]
                logprobs[i] += [float(x) for x in out[RESPONSE_LOGPROBS][k][:room]]
                versions[i] += [int(out[WEIGHT_VERSION])] * min(len(got), room)
                reasons[i] = "length" if len(got) > room else out[FINISH_REASON][k]
                if (len(got) > room or (len(got) == room and reasons[i] == "length")) and len(ids[i]) < budget:
                    full.append(i)
            going = [i for i in full if not self._stopped(ids[i], sampling.get("stop"))]
        return {C.RESPONSE_IDS: ids, RESPONSE_LOGPROBS: logprobs, FINISH_REASON: reasons, WEIGHT_VERSION: first,
                C.BEHAVIOUR_VERSIONS: versions}

    def _stopped(self, ids: list[int], stops) -> bool:
        """Whether a turn's text so far holds one of `stops` (one straddling two segments, which
        neither call's engine saw)."""
        from xray.data.stops import stop_string_end

        tokenizer = getattr(self.maker, "tokenizer", None)
        if not stops or tokenizer is None:
            return False
        return stop_string_end(lambda part: tokenizer.decode(part, skip_special_tokens=True), ids, stops) is not None

    async def _queued(self, prompts: list[list[int]], sampling: dict) -> dict:
        future = asyncio.get_running_loop().create_future()
        self.queue.append((prompts, sampling, future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        while self.queue:
            await asyncio.sleep(FLUSH_S)
            queued, self.queue = self.queue, []
            by_stops: dict[tuple, list] = {}  # one call per stop list (the engine takes one per call)
            for entry in queued:
                by_stops.setdefault(tuple(entry[1].get("stop") or ()), []).append(entry)
            for batch in by_stops.values():
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
        from xray.data.chat import ChatFormat
        from xray.run.episodes.samples import env_factory
        from xray.run.phases import rollout_sampling
        from xray.data.trajectory import TrajectoryLimits
        from xray.run.episodes.runner import EpisodeRunner

        self.maker = maker
        e = maker.cfg.env
        limits = TrajectoryLimits(max_turns=e.max_turns, max_turn_tokens=e.max_turn_tokens, max_tokens=e.max_tokens)
        sampling = dict(rollout_sampling(maker.cfg, maker.stop_ids, maker.index + 1), n=1)
        self.runner = EpisodeRunner(TurnBatcher(maker), tokenizer, env_factory(maker.cfg), limits, sampling,
                                    e.timeout_s, chat=ChatFormat.of(maker.cfg.data))
        self.ended: list[tuple[tuple[int, dict], list, int]] = []
        """Groups whose episodes have all ended, not yet put: (lease entry, trajectories, epoch)."""
        self.flushing: asyncio.Future | None = None

    async def loop(self) -> None:
        """Lease while slots are free (a group put frees one, and wakes the loop), play each lease
        as a task; an episode task's error (never an environment's: those end their episode) stops
        the loop."""
        m = self.maker
        tasks: set[asyncio.Future] = set()
        lease: asyncio.Future | None = None
        freed = m._freed()
        try:
            while True:
                freed.clear()
                free = m.max_in_flight - m.in_flight
                if lease is None and free > 0:
                    lease = asyncio.ensure_future(m.buffer.lease.remote(m.index, free, m.version))
                waiter = asyncio.ensure_future(freed.wait()) if lease is None else None
                done, _ = await asyncio.wait([*tasks, *(t for t in (lease, waiter) if t is not None)],
                                             return_when=asyncio.FIRST_COMPLETED)
                if waiter is not None:
                    waiter.cancel()
                for task in done:
                    if task is lease:
                        leased, lease = task.result(), None
                        if leased:
                            m.in_flight += len(leased)
                            tasks.add(asyncio.ensure_future(self.play(leased)))
                    elif task in tasks:
                        tasks.discard(task)
                        task.result()
        finally:
            for task in [*tasks, *([lease] if lease else []), *([self.flushing] if self.flushing else [])]:
                task.cancel()

    async def play(self, leased: list[tuple[int, dict]]) -> None:
        """The leased prompts' episodes; each prompt's group into the buffer as soon as its
        episodes have ended (`_group_ended`), the others going on."""
        n, epoch = self.maker.cfg.rollout.n_samples, self.maker.epoch
        done: dict[int, Any] = {}
        puts: set[asyncio.Future] = set()

        def ended(i: int, trajectory: Any) -> None:
            done[i] = trajectory
            g = i // n
            if all(k in done for k in range(g * n, g * n + n)):
                puts.add(self._group_ended(leased[g], [done[k] for k in range(g * n, g * n + n)], epoch))

        await self.runner.run([row for _, row in leased for _ in range(n)], ended)
        for put in puts:
            await asyncio.shield(put)  # shared with other leases' groups: a cancelled play leaves it

    def _group_ended(self, entry: tuple[int, dict], trajectories: list, epoch: int) -> asyncio.Future:
        """Queue an ended group; the flush that will put it (with the groups that end within `FLUSH_S`)."""
        self.ended.append((entry, trajectories, epoch))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        return self.flushing

    async def _flush(self) -> None:
        while self.ended:
            await asyncio.sleep(FLUSH_S)
            ended, self.ended = self.ended, []
            await self.put([e for e, _, _ in ended], [t for _, ts, _ in ended for t in ts], [ep for _, _, ep in ended])

    async def put(self, leased: list[tuple[int, dict]], trajectories: list, epochs: list[int]) -> None:
        """The `leased` prompts' episodes (`rollout.n_samples` each, in order; `epochs`: each
        prompt's rollback epoch when it was leased) scored and put into the buffer as one object."""
        from xray.run.episodes.samples import FAILED
        from xray.run.detached.sample import Sample
        from xray.data.trajectory import pack_trajectories

        m, n = self.maker, self.maker.cfg.rollout.n_samples
        batch = pack_trajectories(trajectories, m.pad_id, versions=True)
        keep = torch.tensor([t.end not in FAILED for t in trajectories])
        samples = [Sample(key, row, list(t.tokens), list(t.logprobs),
                          [v for v, model in zip(t.versions, t.mask) if model], True, epochs[k // n])
                   for k, ((key, row), t) in enumerate(zip([x for x in leased for _ in range(n)], trajectories))]
        ref = m._reference(batch)
        groups = [samples[i * n:(i + 1) * n] for i in range(len(leased))]
        counts = [count(trajectories[i * n:(i + 1) * n]) for i in range(len(leased))]
        await m._put(batch, await ref, groups, batch[C.SCORES], keep, range(len(groups)), counts)

    def take_counts(self) -> dict[str, float]:
        """The runner's environment wait and generate calls since the last call."""
        stats = self.runner.stats
        out = {"env_wait_s": float(stats["env_wait_s"]), "generate_calls": float(stats["generate_calls"])}
        stats["env_wait_s"], stats["generate_calls"] = 0.0, 0
        return out


def count(trajectories: list) -> dict[str, int]:
    """One group's episode counts (they travel with it: `Group.counts`)."""
    c: collections.Counter = collections.Counter()
    for t in trajectories:
        calls = int(t.info.get("tool_calls", 0))
        c["episodes"] += 1
        c["turns"] += len(t.turns)
        c["tool_calls"] += calls
        c["tool_episodes"] += calls > 0
        c[f"ends_{t.end}"] += 1
    return dict(c)


def episode_metrics(counts: list[dict[str, float]]) -> dict[str, float]:
    """A step's `episode/*` metrics from the counts of the groups it trained (`count`) and its
    makers' runtime counts (`EpisodeMaking.take_counts`); none when the step trained no episode."""
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
