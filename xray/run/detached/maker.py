"""An experience maker of an asynchronous run (PPO, or a critic-free algorithm): a Ray actor with
its own loop, driving one rollout replica (`xray.run.detached.supervisor` starts one per replica).

Its loop: lease prompts from the buffer (`xray.run.detached.buffer`: admitted only while the
staleness bound allows, at most `async.max_in_flight` in flight), and generate for every sample
in flight at once, `async.segment_tokens` tokens at a time: each segment is one call on the
engine, which batches all of them, and new prompts join at every segment. A sample that ends
(a stop token, or `rollout.max_new_tokens`) leaves; when a prompt's samples have all ended, its
group is scored at once (the reference's log-probs where the run has one, the teacher's with
`distill.teacher_coef` or `opd`, the reward) while the engine generates the others, and put into the buffer as soon as its score is in.

Partial rollouts: a weight load (`load`, called by the trainer when it publishes a version, never
waiting for it) takes the engine between two segments, verified as every sync is; the samples in
flight then go on from the tokens they have with the new weights. Each token records the
version and the engine's log-prob it was sampled with (BEHAVIOUR_VERSIONS, BEHAVIOUR_LOGPROBS),
which the decoupled loss uses per token. A continued sample's prompt is its prompt and the
tokens it has, as exact ids: nothing is re-tokenized.

The experience stays between the engine, this actor, the object store and the trainer: nothing
of it passes through the run's driver.

With `env.name` the loop plays each leased prompt's samples as multi-turn episodes instead
(`xray.run.detached.episode_maker`: many in flight, their turns batched on the engine and generated
`async.segment_tokens` at a time, weight loads between two segments, each prompt's group put as soon
as its episodes end).

Test hook: `slowdown` (`XRAY_MAKER_SLOWDOWN="<maker>:<factor>"` in the driver's environment,
`xray.run.detached.supervisor`) holds the engine `factor` times as long as each segment took: a slow
replica, for the head-of-line and partial-rollout tests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import torch

from xray.run.detached.sample import Sample

log = logging.getLogger(__name__)
FLUSH_S = 0.005
"""Groups whose rewards arrive within this many seconds of each other go into the buffer together."""


class ExperienceMaker:
    """One maker's loop and its engine's weight loads (a Ray actor: `ray.remote(ExperienceMaker)`)."""

    def __init__(self, index: int, rollout, reference, score_fn, buffer, cfg, stop_ids: list[int],
                 pad_id: int, share: int, version: int, slowdown: float = 1.0, tokenizer=None, teacher=None):
        self.index, self.rollout, self.reference, self.teacher = index, rollout, reference, teacher
        self.score_fn, self.buffer, self.cfg = score_fn, buffer, cfg
        self.stop_ids, self.pad_id = stop_ids, pad_id
        a, r = cfg.async_, cfg.rollout
        self.segment = a.segment_tokens or r.max_new_tokens
        self.max_in_flight = a.max_in_flight or share
        self.version = version
        self.latest = (0, version)
        """The newest (rollback epoch, version) published to this maker."""
        self.epoch = 0
        """The trainer's rollbacks this maker has loaded: a version number names other weights
        after a rollback (`xray.run.detached.buffer.ExperienceBuffer.rewind`)."""
        self.active: list[Sample] = []
        """Samples generating."""
        self.pending: dict[int, list[Sample]] = {}
        """Lease key -> its samples, until all have ended (then it is scored)."""
        self.engine: asyncio.Lock | None = None
        self.freed: asyncio.Event | None = None
        self.ready: list = []
        """Groups scored and not yet put (`_flush` puts them together)."""
        self.flushing: asyncio.Future | None = None
        """Set when a put frees slots of `max_in_flight`."""
        self.in_flight = 0
        """Prompts leased and not yet put (generating or being scored)."""
        self.busy: list[tuple[float, float]] = []
        """(start, end) wall-clock seconds of the engine's work: each segment's generation, each
        weight load (a judge's wait is not the maker's work)."""
        self.outbox: dict[int, object] = {}
        """Put number -> a Batch put into the buffer and not yet handed over (`hand_over`)."""
        self.serial_out = 0
        self.making: dict[int, float] = {}
        """Work under way (a serial) -> when it began."""
        self.works = 0
        self.samples = self.segments = self.partial = self.bytes = 0
        self.error: BaseException | None = None
        self.task: asyncio.Future | None = None
        self.slowdown = slowdown
        self.tokenizer = tokenizer
        self.episodes = None
        """With `env.name`: the loop plays episodes (`xray.run.detached.episode_maker`)."""

    def _freed(self) -> asyncio.Event:
        if self.freed is None:
            self.freed = asyncio.Event()
        return self.freed

    def _lock(self) -> asyncio.Lock:
        if self.engine is None:
            self.engine = asyncio.Lock()
        return self.engine

    async def run(self) -> int:
        """The loop, until `stop` (then the samples made) or an error (raised)."""
        self.task = asyncio.ensure_future(self._loop())
        try:
            await self.task
        except asyncio.CancelledError:
            if self.error is not None:
                raise self.error from None
        return self.samples

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def use_models(self, reference=None, teacher=None, reward=None) -> None:
        """Score with these replacements from now on (a reference, teacher or reward model lost a
        Workhorse and was started anew while this maker went on): a call under way on the old one
        still fails, and the supervisor then replaces this maker without counting a second fault."""
        if reference is not None:
            self.reference = reference
        if teacher is not None:
            self.teacher = teacher
        if reward is not None and hasattr(self.score_fn, "reward"):
            self.score_fn.reward = reward

    async def _loop(self) -> None:
        if self.cfg.env.name:
            from xray.run.detached.episode_maker import EpisodeMaking

            self.episodes = EpisodeMaking(self, self.tokenizer)
            return await self.episodes.loop()
        active = self.active
        scoring: set[asyncio.Task] = set()
        try:
            while True:
                for task in [t for t in scoring if t.done()]:
                    scoring.discard(task)
                    task.result()  # a scoring error stops the loop
                await self._admit(active, scoring)
                if active:
                    finished = await self._segment(active)
                    active[:] = [s for s in active if not s.done]
                    if finished:
                        task = asyncio.ensure_future(self._score(finished))
                        scoring.add(task)
        finally:
            for task in scoring:
                task.cancel()

    async def _admit(self, active: list[Sample], scoring: set) -> None:
        """Lease prompts up to `max_in_flight`: at once while samples are generating (they go on
        whatever the answer), else waiting until admission opens. With nothing generating and
        most slots held by groups being scored (a slow judge), wait until a quarter of the slots
        are free: the engine then generates for many prompts at once, not one by one."""
        free = self.max_in_flight - self.in_flight
        if not active and scoring and free < -(-self.max_in_flight // 4):
            freed = self._freed()
            freed.clear()
            waiter = asyncio.ensure_future(freed.wait())  # a group put frees its slot
            await asyncio.wait([waiter, *scoring], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            return
        if free <= 0:
            return
        if active:
            leased = await self.buffer.lease.remote(self.index, free, self.version, wait=False)
        else:
            lease = asyncio.ensure_future(self.buffer.lease.remote(self.index, free, self.version))
            watched = set(scoring)
            while not lease.done():  # a scoring error must not wait for admission
                done, watched = await asyncio.wait([lease, *watched], return_when=asyncio.FIRST_COMPLETED)
                watched = {t for t in watched if t is not lease}
                for task in done:
                    if task is not lease and task.exception() is not None:
                        raise task.exception()
            leased = lease.result()
        n = self.cfg.rollout.n_samples
        for key, row in leased:
            self.pending[key] = [Sample(key, row, epoch=self.epoch) for _ in range(n)]
            active.extend(self.pending[key])
        self.in_flight += len(leased)

    async def _segment(self, active: list[Sample]) -> list[list[Sample]]:
        """Generate the next segment of every active sample; the groups that ended with it."""
        from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS
        from xray.data import columns as C
        from xray.run.phases import rollout_sampling

        limit = self.cfg.rollout.max_new_tokens
        budget = min(self.segment, max(limit - len(s.response) for s in active))
        self.segments += 1
        sampling = rollout_sampling(self.cfg, self.stop_ids, 1_000_003 * (self.index + 1) + self.segments)
        sampling.update(n=1, max_new_tokens=budget)
        out, version = await self.generate([s.row["prompt_ids"] + s.response for s in active], sampling)
        for s, ids, lps, reason in zip(active, out[C.RESPONSE_IDS], out[RESPONSE_LOGPROBS], out[FINISH_REASON]):
            keep = min(len(ids), limit - len(s.response))
            s.response += [int(t) for t in ids[:keep]]
            s.logprobs += [float(x) for x in lps[:keep]]
            s.versions += [version] * keep
            s.done = len(s.response) >= limit or (reason == "stop" and keep == len(ids))
        ended = {s.key for s in active if s.done}  # a group ends with its last sample, in any segment
        return [self.pending.pop(key) for key in sorted(ended) if all(s.done for s in self.pending[key])]

    async def generate(self, prompts: list[list[int]], sampling: dict) -> tuple:
        """One generate call on the engine, between weight loads (the engine's lock), counted as
        busy; (its answer, the weight version that generated it)."""
        async with self._lock():
            start, work = time.time(), self._begin()
            version = self.version
            out = await self.rollout.generate(prompts, sampling)
            if self.slowdown > 1.0:
                await asyncio.sleep((self.slowdown - 1.0) * (time.time() - start))
            self._end(work)
        return out, version

    async def _score(self, groups: list[list[Sample]]) -> None:
        """The reference's (and teacher's) log-probs of the ended groups' samples (one call each), each group's reward,
        and each group into the buffer as soon as its reward is in."""
        from xray.data.sequences import pack_sequences

        samples = [s for g in groups for s in g]
        batch = pack_sequences([s.row["prompt_ids"] for s in samples], [s.response for s in samples],
                               self.pad_id, [s.logprobs for s in samples], [s.versions for s in samples])
        ref = self._reference(batch)
        try:
            if getattr(self.score_fn, "is_async", False):  # a remote judge: each group on its own
                offsets = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
                await asyncio.gather(*[self._score_group(batch, ref, g, o) for g, o in zip(groups, offsets)])
            else:
                scores, keep = await self._scores(samples, batch)
                await self._put(batch, await ref, groups, scores, keep, range(len(groups)))
        except BaseException:
            ref.cancel()
            raise

    def _begin(self) -> int:
        self.works += 1
        self.making[self.works] = time.time()
        return self.works

    def _end(self, work: int) -> None:
        self.busy.append((self.making.pop(work), time.time()))

    async def _score_group(self, batch, ref, group: list[Sample], offset: int) -> None:
        """One group's reward from an `async def` function, then into the buffer with the groups
        whose rewards came in the same few milliseconds (one object and one call for them all)."""
        rows = list(range(offset, offset + len(group)))
        scores, keep = await self.score_fn.acall([s.row for s in group], [s.response for s in group])
        logprobs = (await ref).index(rows)
        keep = torch.ones(len(group), dtype=torch.bool) if keep is None else keep
        self.ready.append((batch.index(rows), logprobs, group, scores, keep))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        await asyncio.shield(self.flushing)

    async def _flush(self) -> None:
        from xray.data import columns as C
        from xray.data.batch import Batch

        await asyncio.sleep(FLUSH_S)
        ready, self.ready = self.ready, []
        batch = Batch.concat([r[0] for r in ready], pad_width=True)
        logprobs = Batch.concat([r[1] for r in ready], pad_width=True)
        width = batch[C.LOSS_MASK].shape[1]
        logprobs = Batch({k: v[:, :width] for k, v in logprobs.tensors.items()})
        await self._put(batch, logprobs, [r[2] for r in ready], torch.cat([r[3] for r in ready]),
                        torch.cat([r[4] for r in ready]), range(len(ready)))

    def _reference(self, batch):
        """A task of the reference's log-probs of `batch` (LOGPROBS) and, with a teacher, the
        teacher's (TEACHER_LOGPROBS), the two forwards at once; each model's input padded with
        copies of its first row to a multiple of its dp, whose ranks all take part in every
        forward, and cut back. A run without a reference (a critic-free one with its KL off) or a
        teacher leaves their column out."""
        from xray.data import columns as C
        from xray.data.batch import Batch

        async def forward(model):
            extra = -len(batch) % model.parallel.dp
            padded = Batch.concat([batch, *[batch.index([0])] * extra]) if extra else batch
            out = await model.forward(padded.select([C.INPUT_IDS, C.ATTENTION_MASK]))
            return out[C.LOGPROBS][:len(batch)]

        async def both():
            models = {C.LOGPROBS: self.reference, C.TEACHER_LOGPROBS: self.teacher}
            models = {column: model for column, model in models.items() if model is not None}
            answers = await asyncio.gather(*map(forward, models.values()))
            return Batch(dict(zip(models, answers)))
        return asyncio.ensure_future(both())

    async def _scores(self, samples: list[Sample], batch):
        """A reward model scores the batch by reference (padded to its dp); a function in a thread."""
        from xray.data import columns as C
        from xray.data.batch import Batch

        rows = [s.row for s in samples]
        if hasattr(self.score_fn, "ascore"):
            dp = self.score_fn.reward.parallel.dp
            extra = -len(batch) % dp
            padded = Batch.concat([batch, *[batch.index([0])] * extra]) if extra else batch
            scores, keep = await self.score_fn.ascore(rows + [rows[0]] * extra, padded)
            return scores[:len(batch)], None if keep is None else keep[:len(batch)]
        return await asyncio.to_thread(self.score_fn, rows, list(batch[C.RESPONSE_IDS]))

    async def _put(self, batch, ref, groups: list[list[Sample]], scores, keep, which,
                   counts: list[dict] | None = None) -> None:
        """The groups' rows into the object store as one Batch (cut to its longest row), and the
        groups into the buffer (`counts`: each group's episode counts, which go with it)."""
        import ray

        from xray.run.detached.buffer import Group
        from xray.data import columns as C
        from xray.data.batch import Batch

        mask = batch[C.LOSS_MASK] if keep is None else batch[C.LOSS_MASK] * keep[:, None].float()
        whole = Batch({C.INPUT_IDS: batch[C.INPUT_IDS], C.ATTENTION_MASK: batch[C.ATTENTION_MASK], C.LOSS_MASK: mask,
                       C.BEHAVIOUR_LOGPROBS: batch[C.BEHAVIOUR_LOGPROBS],
                       C.BEHAVIOUR_VERSIONS: batch[C.BEHAVIOUR_VERSIONS], C.SCORES: scores,
                       **({C.REF_LOGPROBS: ref[C.LOGPROBS]} if C.LOGPROBS in ref else {}),
                       **({C.TEACHER_LOGPROBS: ref[C.TEACHER_LOGPROBS]} if C.TEACHER_LOGPROBS in ref else {})},
                      {C.PROMPT_IDS: batch[C.PROMPT_IDS], C.RESPONSE_IDS: batch[C.RESPONSE_IDS]})
        # one object for the groups scored together; in an actor, handed over to the buffer, which owns
        # it (`hand_over`): queued, it outlives this maker (a maker in a benchmark's process puts it)
        me = _own_handle()
        if me is None:
            ref, serial = ray.put(_trimmed(whole)), 0
        else:
            self.serial_out += 1
            ref, serial = None, self.serial_out
            self.outbox[serial] = _trimmed(whole)
        entries, first = [], 0
        for i in which:
            group = groups[i]
            rows = (first, first + len(group))
            first += len(group)
            versions = [v for s in group for v in s.versions]
            self.partial += sum(len(set(s.versions)) > 1 for s in group)
            entries.append(Group([ref, *rows], min(versions, default=self.version), self.index,
                                 int(mask[rows[0]:rows[1]].sum()), group[0].row, group[0].key,
                                 newest=max(versions, default=self.version), epoch=min(s.epoch for s in group),
                                 counts=counts[i] if counts else {}))
        self.bytes += whole.nbytes()
        self.samples += first
        self.in_flight -= len(entries)
        self._freed().set()
        await (self.buffer.put.remote(entries) if me is None else self.buffer.put.remote(entries, me, serial))

    def hand_over(self, serial: int):
        """The Batch of put number `serial` (`_put`), called by the buffer: the object this returns is
        the buffer's (Ray's caller owns a call's result), made here in the object store, no copy."""
        return self.outbox.pop(serial)

    async def load(self, staged, epoch: int = 0, floor: int = -1) -> tuple | None:
        """Load a published weight version into the engine between two segments, verified
        (`xray.sync.deliver`); (its SyncReport, when loaded: wall-clock seconds), or None when a
        newer version arrived meanwhile (that one is loaded instead) or the trainer has since
        rolled back past it. A failure stops the loop.

        `epoch` counts the trainer's rollbacks (`AsyncTrainer.recover`), the last of which went back
        to version `floor`: at the first load of a newer epoch, the samples in the making lose
        their tokens sampled by newer versions (`_roll_back`), and an engine holding one of those
        loads this version whatever else is on its way."""
        from xray.sync import deliver

        from xray.wholemodel.errors import WholeModelError

        if epoch < self.epoch:
            return None
        self.latest = max(self.latest, (epoch, staged.version))
        try:
            await staged.export
        except WholeModelError as lost:  # the trainer lost its actor while exporting: nothing was loaded,
            log.warning("maker %d: weight version %d was never exported (%s); keeping version %d",  # it restores
                        self.index, staged.version, str(lost).splitlines()[0], self.version)
            return None
        try:
            async with self._lock():
                if epoch < self.epoch:
                    return None
                discarded = epoch > self.epoch and self.version > floor
                if epoch > self.epoch:
                    self._roll_back(floor, epoch)
                if not discarded and ((epoch, staged.version) < self.latest or staged.version <= self.version):
                    return None
                work = self._begin()
                report = await deliver(staged, self.rollout, self.cfg.sync)
                self.version = report.version
                self._end(work)
        except BaseException as exc:
            self.error = exc
            self.stop()
            raise
        await self.buffer.set_maker_version.remote(self.index, self.version)
        return report, time.time()

    def _roll_back(self, floor: int, epoch: int) -> None:
        """The trainer went back to version `floor` (its rollback `epoch`): the groups in the making
        lose their tokens sampled by newer versions (a prefix stays: versions never decrease
        along a sample) and go on from there; a sample that had ended and lost tokens generates
        again. Groups already being scored keep their epoch: the buffer re-makes them if needed."""
        self.epoch = epoch
        for group in self.pending.values():
            for s in group:
                keep = sum(v <= floor for v in s.versions)
                if keep < len(s.versions):
                    del s.response[keep:], s.logprobs[keep:], s.versions[keep:]
                    if s.done:
                        s.done = False
                        self.active.append(s)
                s.epoch = epoch

    def stats(self) -> dict:
        """The busy intervals since the last call, those under way up to now (merged; the caller clips
        them to its window), the samples made so far and those that span weight versions; each
        reward function's (sum, count) of scores since the last call (`rewards`)."""
        now = time.time()
        intervals, self.busy = sorted([*self.busy, *((a, now) for a in self.making.values())]), []
        merged: list[list[float]] = []
        for a, b in intervals:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return {"busy": [tuple(m) for m in merged], "samples": self.samples, "version": self.version,
                "partial": self.partial, "in_flight": self.in_flight, "segments": self.segments,
                "bytes": self.bytes, **({"episodes": self.episodes.take_counts()} if self.episodes else {}),
                **({"rewards": self.score_fn.tally.take_counts()} if hasattr(self.score_fn, "tally") else {})}

    def pid(self) -> int:
        return os.getpid()


def _own_handle():
    """This actor's handle, or None outside an actor (a benchmark runs a maker in its own process)."""
    import ray

    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def _trimmed(batch):
    """`batch` cut to its longest row (a group's rows were packed beside longer ones)."""
    from xray.data import columns as C
    from xray.data.batch import Batch

    width = int(batch[C.ATTENTION_MASK].sum(1).max())
    return Batch({k: v[:, :width] if v.dim() > 1 and v.shape[1] == batch[C.INPUT_IDS].shape[1] else
                  v[:, :width - 1] if v.dim() > 1 else v for k, v in batch.tensors.items()},
                 dict(batch.lists), dict(batch.meta))
