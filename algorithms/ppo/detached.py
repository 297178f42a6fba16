"""Detached asynchronous PPO (`trainer.mode: async`): experience makers and trainers joined by a buffer.

ColossalChat's design on xray's WholeModels, all on the run's one event loop:
- each **experience maker** drives one rollout replica (`rollout.replica(m)`): it takes one
  trainer's share of a rollout batch of prompts, samples with the weights it holds (recording
  their version and the engine's own log-probs, the behaviour policy), has the reference model
  score them by reference and the reward score them, and puts the experience batch into the
  buffer (`algorithms.ppo.buffer`) for the trainer the graph (`async.feeds`) and the queues pick;
- the **trainers** are the actor's data-parallel replicas (with the critic): a trainer step takes
  one batch per trainer, so each replica trains on its own makers' experience; it recomputes
  log-probs (the proximal policy) and values with the current weights, computes advantages, trains
  with the decoupled PPO loss (`PolicyLoss` with a truncated behaviour weight), and every
  `async.push_every` steps trainer d pushes its weights to the makers `async.pushes` gives it,
  each push verified and made under that maker's lock only, so the other makers keep sampling.
With `on_stale: wait` a maker whose weights are more than `max_staleness` versions behind the
trainers' waits for a push. A checkpoint holds the buffer's experiences (with their versions and
behaviour log-probs) and the prompts of batches still being made; a resume queues both again,
and the makers start from the checkpoint's weights. Interleaving is not deterministic: runs are
not bitwise repeatable.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from algorithms.ppo.buffer import Entry, maker_must_wait
from algorithms.ppo.kl_estimators import kl_metrics
from algorithms.ppo.trainer import ppo_targets
from xray.config.graph import build_graph
from xray.data import columns as C
from xray.data.batch import Batch
from xray.sync import deliver, stage


@dataclass
class MakerStats:
    """What the makers did since the last trainer step."""

    busy: list = field(default_factory=list)
    """(start, end) perf-counter seconds of each batch a maker finished making."""
    samples: int = 0
    waited: int = 0
    """Times a maker waited for new weights (on_stale: wait)."""
    full_waits: int = 0
    """Times a maker waited for room in its trainers' queues."""


@dataclass
class Detached:
    """Makers and trainers of one asynchronous run around a PPOTrainer (its models, losses, data)."""

    trainer: object
    next_rows: object
    """Callable giving the next rollout batch of prompt rows."""
    makers: list = field(default_factory=list)
    locks: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    """The weight version each maker holds."""
    version: int = 0
    """The trainers' weight version: trainer steps done."""
    stats: MakerStats = field(default_factory=MakerStats)

    def __post_init__(self) -> None:
        import ray

        from algorithms.ppo.buffer import BufferActor

        cfg, models = self.trainer.cfg, self.trainer.models
        self.makers = [models.rollout.replica(d) for d in range(models.rollout.parallel.dp)]
        self.graph = build_graph(cfg.async_.feeds, cfg.async_.pushes, len(self.makers), models.actor.parallel.dp)
        self.locks = [asyncio.Lock() for _ in self.makers]
        self.versions = [self.trainer.state.step] * len(self.makers)
        self.version = self.trainer.state.step
        self.share = cfg.ppo.rollout_batch_size // self.graph.trainers
        """Prompts per maker batch: one trainer's share of a rollout batch."""
        self.rows: deque = deque()
        """Prompt rows drawn from the sampler and not yet taken by a maker."""
        self.in_flight: dict[int, tuple[int, list]] = {}
        """Maker -> (serial, prompt rows) of the batch it is making."""
        self.making: dict[int, float] = {}
        """Maker -> when it began the batch it is making (perf-counter seconds)."""
        self.serial = 0
        self.claimed = [self.version] * self.graph.trainers
        """Per trainer, the last index claimed (the trainer step its batch is for)."""
        self.outstanding = [0] * self.graph.trainers
        """Per trainer, batches claimed and not yet taken: being made or in the buffer."""
        self.changed = asyncio.Condition()
        """Notified when a claim may have become possible: a take, a push."""
        self.deliveries: list[asyncio.Future] = []
        """The last push's deliveries to the makers, in flight."""
        self.buffer = ray.remote(BufferActor).options(num_cpus=0).remote(
            cfg.async_.buffer_capacity, cfg.async_.max_staleness, self.graph.trainers, self.version + 1)

    # -- makers ----------------------------------------------------------------------------------
    def _take_rows(self) -> list[dict]:
        while len(self.rows) < self.share:
            self.rows.extend(self.next_rows())
        return [self.rows.popleft() for _ in range(self.share)]

    def _claimable(self, i: int) -> tuple[int, int] | str:
        """Maker i's place: (trainer, index) with room (the fewest outstanding of its trainers),
        or why it must wait: "full", or "stale" (its weights too old for that index)."""
        acfg = self.trainer.cfg.async_
        open_ = [d for d in self.graph.feeds[i] if self.outstanding[d] < acfg.buffer_capacity]
        if not open_:
            return "full"
        d = min(open_, key=lambda d: (self.outstanding[d], d))
        if maker_must_wait(acfg.on_stale, self.claimed[d] + 1, self.versions[i], acfg.max_staleness):
            return "stale"
        return d, self.claimed[d] + 1

    async def claim(self, i: int) -> tuple[int, int]:
        """Wait until maker i may begin a batch; claim its place in a trainer's queue."""
        async with self.changed:
            while isinstance(found := self._claimable(i), str):
                if found == "stale":
                    self.stats.waited += 1
                else:
                    self.stats.full_waits += 1
                await self.changed.wait()
            d, index = found
            self.claimed[d], self.outstanding[d] = index, self.outstanding[d] + 1
            return d, index

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def maker(self, i: int) -> None:
        """Maker `i`'s loop: claim, sample, score, put; forever (cancelled at the end of the run)."""
        t = self.trainer
        while True:
            trainer, index = await self.claim(i)
            rows = self._take_rows()
            self.serial += 1
            serial = self.serial
            self.in_flight[i] = (serial, rows)
            start = self.making[i] = time.perf_counter()
            async with self.locks[i]:
                version = self.versions[i]
                gen = self.makers[i].generate([r["prompt_ids"] for r in rows],
                                              t.sampling(1_000_003 * (i + 1) + serial), pad_id=t.pad_id)
                ref = t.models.reference.forward(gen)  # by reference, queued before the answer is in
                exp = await gen
            rows = [rows[j // t.cfg.rollout.n_samples] for j in range(len(exp))]
            scores, keep = await t.score(rows, exp, gen)
            mask = exp[C.LOSS_MASK] if keep is None else exp[C.LOSS_MASK] * keep[:, None].float()
            batch = Batch({C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK],
                           C.LOSS_MASK: mask, C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS],
                           C.REF_LOGPROBS: (await ref)[C.LOGPROBS], C.SCORES: scores},
                          {C.PROMPT_IDS: exp[C.PROMPT_IDS], C.RESPONSE_IDS: exp[C.RESPONSE_IDS]})
            self.stats.busy.append((start, time.perf_counter()))
            self.stats.samples += len(batch)
            del self.making[i]
            await self.buffer.put.remote(Entry([_put(batch)], version, i, serial, index), trainer)
            del self.in_flight[i]

    # -- trainers --------------------------------------------------------------------------------
    async def take(self, makers: list[asyncio.Task]) -> tuple[list[Entry], int]:
        """One entry per trainer, and the largest staleness among them; a maker that failed stops
        the run with its error."""
        taking = asyncio.ensure_future(self.buffer.take.remote(self.version))
        done, _ = await asyncio.wait([taking, *makers], return_when=asyncio.FIRST_COMPLETED)
        for task in makers:
            if task in done:
                taking.cancel()
                task.result()  # raises the maker's error
                raise RuntimeError("an experience maker stopped without an error")
        taken, dropped = taking.result()
        for d in range(self.graph.trainers):
            self.outstanding[d] -= 1 + dropped[d]
        await self._notify()
        return [entry for entry, _ in taken], max(staleness for _, staleness in taken)

    def maker_busy(self, made: MakerStats, start: float, end: float) -> float:
        """The makers' mean busy share of [start, end]: the time each spent making batches (those
        finished, and the ones still in the making, up to `end`), clipped to the window."""
        intervals = [*made.busy, *((since, end) for since in self.making.values())]
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)  # a maker's own never overlap
        return busy / ((end - start) * len(self.makers))

    async def step(self, step: int, makers: list[asyncio.Task]) -> dict[str, float]:
        """One trainer step: take a batch per trainer, recompute, train, push every `push_every` steps."""
        t, acfg = self.trainer, self.trainer.cfg.async_
        start = time.perf_counter()
        entries, staleness = await self.take(makers)
        exp = Batch.concat(await asyncio.gather(*[e.item[0] for e in entries]), pad_width=True)
        self.last = exp
        waited_s = time.perf_counter() - start
        proximal, values = await asyncio.gather(t.models.actor.forward(exp), t.models.critic.forward(exp))
        mask = exp[C.LOSS_MASK]
        advantages, returns = ppo_targets(proximal[C.LOGPROBS], exp[C.REF_LOGPROBS], values[C.VALUES], mask,
                                          exp[C.SCORES], t.cfg, t.kl.value)
        train = await t.train(Batch({
            C.INPUT_IDS: exp[C.INPUT_IDS], C.ATTENTION_MASK: exp[C.ATTENTION_MASK], C.LOSS_MASK: mask,
            C.OLD_LOGPROBS: proximal[C.LOGPROBS], C.BEHAVIOUR_LOGPROBS: exp[C.BEHAVIOUR_LOGPROBS],
            C.OLD_VALUES: values[C.VALUES], C.ADVANTAGES: advantages, C.RETURNS: returns}), step,
            parts=len(entries))
        kl, kl_coef = kl_metrics(proximal[C.LOGPROBS], exp[C.REF_LOGPROBS], mask), t.kl.value
        t.kl.update(kl["kl_sequence"], len(exp))
        delivering = time.perf_counter()
        sync = await self.delivered()  # the previous push travelled while this step trained
        waited_s += time.perf_counter() - delivering
        self.version = t.state.step = step
        if step % acfg.push_every == 0:
            self.push(exp)
        end = time.perf_counter()
        wall = end - start
        made, self.stats = self.stats, MakerStats()
        scores = exp[C.SCORES]
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                **kl, "kl_coef": kl_coef, **train, **t.gap(proximal[C.LOGPROBS], exp, mask),
                "response_length": float(mask.sum(1).mean()), "async/staleness": float(staleness),
                **{f"async/trainer{d}_maker": float(e.maker) for d, e in enumerate(entries)},
                "async/waited": float(made.waited), "async/buffer_full_waits": float(made.full_waits),
                "async/trainer_busy": 1.0 - waited_s / wall, "async/maker_busy": self.maker_busy(made, start, end),
                "samples_per_s": len(exp) / wall, **sync, **(await self.buffer.stats.remote())}

    def push(self, exp: Batch) -> None:
        """Stage the trainers' weights at their version (one export per pushing trainer, queued on
        the actor before anything else, so the next step trains on while they travel) and deliver
        each maker its trainer's copy (`async.pushes`) as soon as the maker is between batches,
        verified, under that maker's lock: no maker stops the others or the trainers."""
        sequences, prompt_lens = self.trainer.probe(exp)
        cfg, actor = self.trainer.cfg.sync, self.trainer.models.actor
        staged = {d: stage(actor, self.version, cfg, sequences, prompt_lens, replica=d)
                  for d in sorted(set(self.graph.pusher))}

        async def one(i: int):
            async with self.locks[i]:
                report = await deliver(staged[self.graph.pusher[i]], self.makers[i], cfg)
                self.versions[i] = report.version
            await self._notify()
            return report

        self.deliveries = [asyncio.ensure_future(one(i)) for i in range(len(self.makers))]

    async def delivered(self) -> dict[str, float]:
        """Wait for the last push's deliveries; their verification, for the step's metrics."""
        if not self.deliveries:
            return {}
        reports = await asyncio.gather(*self.deliveries)
        self.deliveries = []
        return {"sync/max_abs_logprob_diff": max(r.max_abs_logprob_diff for r in reports),
                "sync/held_checked": float(sum(r.held_checked for r in reports)),
                "sync/held_unreadable": float(sum(r.held_unreadable for r in reports)),
                "sync/verify_s": max(r.verify_s for r in reports), "sync/version": float(reports[0].version)}

    # -- checkpoints -----------------------------------------------------------------------------
    def capture(self) -> dict:
        """What must be read at the checkpoint's instant, synchronously (no maker runs meanwhile):
        the batches being made and the prompts drawn but not taken. `state_dict` completes it."""
        return {"in_flight": dict(self.in_flight), "rows": list(self.rows), "serial": self.serial}

    async def state_dict(self, captured: dict) -> dict:
        """The async part of a checkpoint: the buffer's experiences made before the capture (as
        batches, with version, maker and trainer) and the prompts of every batch made after it or
        not finished, to be made again; the makers' weight versions, for the record."""
        entries = [(t, e) for t, e in await self.buffer.snapshot.remote() if e.serial <= captured["serial"]]
        queued = {e.serial for _, e in entries}
        batches = await asyncio.gather(*[e.item[0] for _, e in entries])
        again = [row for serial, rows in sorted(captured["in_flight"].values(), key=lambda sr: sr[0])
                 if serial not in queued for row in rows]
        return {"entries": [{"trainer": t, "version": e.version, "maker": e.maker, "serial": e.serial,
                             "index": e.index, "batch": b} for (t, e), b in zip(entries, batches)],
                "rows": again + captured["rows"], "maker_versions": list(self.versions)}

    async def load_state_dict(self, state: dict, version: int) -> None:
        """Resume at trainer `version` (before `run`): the makers hold its weights, and the
        checkpoint's experiences are queued again, in their order, for the next steps; its
        prompts are made again first."""
        self.version, self.versions = version, [version] * len(self.makers)
        self.claimed, self.outstanding = [version] * self.graph.trainers, [0] * self.graph.trainers
        entries = []
        for e in sorted(state["entries"], key=lambda e: (e["trainer"], e["index"])):
            d = e["trainer"]
            self.claimed[d], self.outstanding[d] = self.claimed[d] + 1, self.outstanding[d] + 1
            entries.append((d, Entry([_put(e["batch"])], e["version"], e["maker"], e["serial"], self.claimed[d])))
        await self.buffer.restore.remote(entries, version + 1)
        self.rows = deque(state["rows"])
        self.serial = max([e["serial"] for e in state["entries"]], default=0)

    # -- the run ---------------------------------------------------------------------------------
    async def run(self, steps: range, on_step, stop=None, on_stop=None) -> None:
        """Trainer steps `steps` with the makers running beside them; awaits `on_step(step, metrics)`
        after each (metrics, checkpoints); ends early when `stop` (a `GracefulStop`) is requested,
        awaiting `on_stop()` (the last checkpoint) while the buffer still stands."""
        makers = [asyncio.ensure_future(self.maker(i)) for i in range(len(self.makers))]
        try:
            for step in steps:
                if stop is not None and stop.requested:
                    break
                metrics = await (stop.guard(self.step(step, makers)) if stop is not None else self.step(step, makers))
                if metrics is None:
                    break
                await on_step(step, metrics)
            if stop is not None and stop.requested and on_stop is not None:
                await on_stop()
        finally:
            for task in makers:
                task.cancel()
            await asyncio.gather(*makers, return_exceptions=True)
            import ray

            ray.kill(self.buffer)
        await self.delivered()
        if self.versions != [self.version] * len(self.makers) and getattr(self, "last", None) is not None:
            self.push(self.last)  # the makers end on the trainers' last weights (for the eval)
            await self.delivered()


def _put(batch: Batch):
    import ray

    return ray.put(batch)
