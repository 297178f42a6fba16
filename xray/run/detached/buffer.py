"""The experience buffer of asynchronous PPO: the prompt source, admission control and the queues
of scored groups between the experience makers (`xray.run.detached.maker`) and the trainer
(`xray.run.detached.trainer`).

It holds object references, never the experiences themselves (they stay in Ray's object store
where a maker made them). The buffer owns them: a maker's `put` names the batch it holds, and the
buffer calls for it (`ExperienceMaker.hand_over`), so the object is the result of the buffer's own
call, made in the maker's object store and owned by the buffer (Ray 2.56 removed `ray.put`'s
`_owner`). A group queued here outlives the maker that made it (a replaced maker takes nothing
queued with it). One place owns everything that must be read at one instant for a
lossless checkpoint: the prompt sampler, the prompts queued again, the prompts each maker is
making (leased, not yet put) and the scored groups waiting to be trained on.

- A maker **leases** prompts (`lease`), up to as many as it asks for and as many as admission
  allows: queued prompts first, then the sampler's. The trainer it would feed is the one of its
  graph's `async.feeds` with most room. With `on_stale: wait` admission is AReaL's rule, per
  trainer d: a maker holding weight version v may start a prompt only while
  `(max_staleness + v + 1) x share - (accepted_d + running_d) > 0`, where `share` is the groups
  trainer d takes a step, `accepted_d` the groups put for d so far (trained included) and
  `running_d` those leased and not yet put: a prompt started then is among the first
  `v + max_staleness + 1` steps' worth, so it is trained at most `max_staleness` versions after v
  unless a slower maker's groups overtake it. Both modes also keep at most `capacity` steps'
  worth per trainer, queued or being made.
- A maker **puts** each prompt's group of samples as soon as it is scored (`put`), with the
  oldest weight version among its tokens and its token count.
- The trainer **takes** (`take`) the first `share` ready groups of each trainer's queue, from
  whichever makers made them, in the order they arrived: a slow maker holds up no one else.
  A group older than `max_staleness` when taken is queued again as a prompt (`on_stale: wait`:
  nothing lost, made again with newer weights) or dropped and counted (`drop`: its prompt lost).
- A lost maker's leases are queued again (`requeue`): nothing lost, nothing trained twice.
- A taken group whose experience is gone from the object store (its node lost) is queued again
  as a prompt and the trainer takes another in its place (`give_back`, `take_experience`): the
  groups fetched go back first in line, in their order.
- A trainer that lost its Workhorses goes back to a snapshot (`rewind`): the versions after it
  are discarded, and a group with tokens they sampled (queued, or put by a maker that had not
  yet loaded the restored weights) is queued again as a prompt.

`ExperienceBuffer` is the policy, plain and unit-tested; `BufferActor` serves it as an
asynchronous Ray actor (its `lease` and `take` may wait).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """One prompt's scored samples in a queue."""

    item: Any
    """Where its rows are: [object reference of a Batch the maker put, first row, end row] (the
    groups scored together share one Batch)."""
    version: int
    """The oldest weight version that sampled any of its tokens."""
    maker: int
    tokens: int
    """Response tokens in the group (staleness is counted per token)."""
    row: dict
    """The prompt row, to make it again if it comes out too stale."""
    key: int = 0
    """The lease of its prompt (identifies it across a checkpoint)."""
    newest: int = -1
    """The newest weight version that sampled any of its tokens."""
    epoch: int = 0
    """The trainer's rollbacks its maker had loaded when its tokens were last sampled: a version
    number names other weights after a rollback (`ExperienceBuffer.rewind`)."""
    counts: dict = field(default_factory=dict)
    """Its episodes' counts (`xray.run.detached.episode_maker.count`; empty without episodes): they
    travel with it, so the step that trains it reports them whichever maker played it."""


@dataclass
class Lease:
    """A prompt a maker is making."""

    maker: int
    trainer: int
    row: dict
    version: int


HELD_TAKES = 8
"""Takes the buffer keeps in hand (`ExperienceBuffer.in_hand`): more than a trainer ever goes back
(its newest complete snapshot in memory, at most a step or two behind its last take)."""


@dataclass
class ExperienceBuffer:
    """Prompts, leases and per-trainer queues of scored groups; admission and staleness counted."""

    share: int
    """Groups (prompts) each trainer takes a step: rollout_batch_size / trainers."""
    feeds: list
    """Per maker, the trainers it may feed."""
    draw: Callable[[], list]
    """The sampler's next batch of prompt rows."""
    max_staleness: int = 1
    on_stale: str = "wait"
    capacity: int = 2
    """Steps' worth of groups each trainer's queue holds, counting those being made for it."""
    version: int = 0
    """The trainer's weight version: steps done."""
    rows: deque = field(default_factory=deque)
    """Prompts queued to be made before the sampler's next: a lost maker's, too-stale ones, a resume's."""
    leases: dict = field(default_factory=dict)
    """Lease key -> `Lease`: prompts being made."""
    serial: int = 0
    queues: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    running: list = field(default_factory=list)
    dropped: int = 0
    requeued_stale: int = 0
    late: int = 0
    """Groups put under a lease that was no longer held (its maker had been replaced): ignored."""
    drawn: list = field(default_factory=list)
    """Rows drawn from the sampler and not yet leased."""
    epoch: int = 0
    """The trainer's rollbacks so far (`rewind`)."""
    floors: dict = field(default_factory=dict)
    """Rollback epoch -> the version the trainer went back to: a group sampled before that
    rollback by a newer version was sampled by weights the trainer discarded."""
    requeued_rollback: int = 0
    requeued_lost: int = 0
    """Taken groups whose experience was gone from the object store, queued again as prompts."""
    in_hand: dict = field(default_factory=dict)
    """Trainer step -> the groups its take returned, for the last `HELD_TAKES` takes: a trainer that
    goes back to a snapshot (its models lost, or the trainer actor itself) has them given back
    (`back_to`), trained again, not skipped; the buffer outlives the trainer."""
    last_taken: int = 0
    """The step of the last take."""

    def __post_init__(self) -> None:
        if self.share < 1 or self.max_staleness < 0 or self.capacity < 1:
            raise ValueError(f"share={self.share} and capacity={self.capacity} must be >= 1 and "
                             f"max_staleness={self.max_staleness} >= 0")
        trainers = 1 + max(t for targets in self.feeds for t in targets)
        self.queues = [[] for _ in range(trainers)]
        self.accepted = [self.version * self.share] * trainers
        self.running = [0] * trainers
        self.last_taken = self.version

    @property
    def trainers(self) -> int:
        return len(self.queues)

    def room(self, trainer: int, maker_version: int) -> int:
        """Groups a maker holding `maker_version` may still start for `trainer`."""
        d = trainer
        room = self.capacity * self.share - (len(self.queues[d]) + self.running[d])
        if self.on_stale == "wait":
            room = min(room, (self.max_staleness + maker_version + 1) * self.share - (self.accepted[d] + self.running[d]))
        return room

    def lease(self, maker: int, most: int, maker_version: int) -> list[tuple[int, dict]]:
        """Up to `most` (lease key, prompt row) pairs for `maker`, as many as admission allows now
        (none: wait for a take or a newer version)."""
        rooms = {d: self.room(d, maker_version) for d in self.feeds[maker]}
        d = max(rooms, key=lambda d: (rooms[d], -d))
        leased = []
        for _ in range(min(most, rooms[d])):
            if not self.rows and not self.drawn:
                self.drawn = list(self.draw())
            row = self.rows.popleft() if self.rows else self.drawn.pop(0)
            self.serial += 1
            self.leases[self.serial] = Lease(maker, d, row, maker_version)
            self.running[d] += 1
            leased.append((self.serial, row))
        return leased

    def put(self, groups: list[Group]) -> int:
        """Scored groups into their trainers' queues; how many were accepted (a group whose lease
        is no longer held, its maker replaced and its prompt queued again, is ignored)."""
        accepted = 0
        for g in groups:
            held = self.leases.pop(g.key, None)
            if held is None:
                self.late += 1
                continue
            self.running[held.trainer] -= 1
            if self.discarded(g):  # made again with the weights the trainer went back to
                self.rows.appendleft(g.row)
                self.requeued_rollback += 1
                continue
            self.accepted[held.trainer] += 1
            self.queues[held.trainer].append(g)
            accepted += 1
        return accepted

    def take(self, trainer_version: int) -> list[list[Group]] | None:
        """The first `share` ready groups of every trainer's queue (in arrival order), or None
        (nothing taken) while a queue has fewer. Too-stale groups are first queued again as
        prompts (`wait`) or dropped (`drop`)."""
        self.version = trainer_version
        for d, queue in enumerate(self.queues):
            stale = [g for g in queue if trainer_version - g.version > self.max_staleness]
            queue[:] = [g for g in queue if trainer_version - g.version <= self.max_staleness]
            if self.on_stale == "wait":  # first in line, in the order they came
                self.rows.extendleft(reversed([g.row for g in stale]))
                self.accepted[d] -= len(stale)
                self.requeued_stale += len(stale)
            else:
                self.dropped += len(stale)
        if any(len(q) < self.share for q in self.queues):
            return None
        taken = []
        for queue in self.queues:
            taken.append(queue[:self.share])
            del queue[:self.share]
        self.last_taken = trainer_version + 1  # a take retried after a loss replaces the step's entry
        self.in_hand[self.last_taken] = taken
        for step in [s for s in self.in_hand if s <= self.last_taken - HELD_TAKES]:
            del self.in_hand[step]
        return taken

    def back_to(self, step: int, epoch: int) -> int:
        """The trainer went back to the snapshot of `step` (its rollback number `epoch`): the groups
        of its takes since (`in_hand`) go back to the front of their queues, in their order; then
        `rewind` (the steps taken whose groups are no longer in hand count as never accepted, the
        versions above `step` are discarded). How many steps' groups were given back."""
        steps = sorted(s for s in self.in_hand if s > step)
        if steps:
            self.give_back([[g for s in steps for g in self.in_hand[s][d]] for d in range(self.trainers)], set())
        for s in steps:
            del self.in_hand[s]
        self.rewind(step, max(0, self.last_taken - step - len(steps)), epoch)
        self.last_taken = step
        return len(steps)

    def give_back(self, taken: list[list[Group]], lost: set[tuple[int, int]]) -> int:
        """Undo a `take` whose groups at `lost` ((trainer, index) in `taken`) could not be fetched: the
        others go back to the front of their queues, in their order; the lost ones' prompts are queued
        again, first in line, and no longer count as accepted (the makers make them again). How many."""
        gone = 0
        for d, groups in enumerate(taken):
            kept = [g for i, g in enumerate(groups) if (d, i) not in lost]
            self.queues[d][:0] = kept
            missing = [g for i, g in enumerate(groups) if (d, i) in lost]
            self.rows.extendleft(reversed([g.row for g in missing]))
            self.accepted[d] -= len(missing)
            gone += len(missing)
        self.requeued_lost += gone
        return gone

    def rewind(self, version: int, steps: int, epoch: int) -> None:
        """The trainer went back to `version` (its rollback number `epoch`) after taking `steps`
        steps' groups it never trained on (its loss): admission counts them as never accepted, so
        the makers make them again. Versions above `version` now name other weights: the groups
        sampled by them, queued or put later, are made again (`discarded`)."""
        self.version, self.epoch = version, epoch
        self.floors[epoch] = version
        self.accepted = [max(0, a - steps * self.share) for a in self.accepted]
        for d, queue in enumerate(self.queues):
            gone = [g for g in queue if self.discarded(g)]
            queue[:] = [g for g in queue if not self.discarded(g)]
            self.rows.extendleft(reversed([g.row for g in gone]))
            self.accepted[d] = max(0, self.accepted[d] - len(gone))
            self.requeued_rollback += len(gone)

    def discarded(self, g: Group) -> bool:
        """Whether some of `g`'s tokens were sampled by a version that a later rollback discarded."""
        return any(g.newest > floor for epoch, floor in self.floors.items() if epoch > g.epoch)

    def requeue(self, maker: int) -> int:
        """Queue the prompts `maker` was making again (it was lost), first in line; how many."""
        lost = sorted(k for k, held in self.leases.items() if held.maker == maker)
        for k in lost:
            self.running[self.leases[k].trainer] -= 1
        self.rows.extendleft(reversed([self.leases.pop(k).row for k in lost]))
        return len(lost)

    def stats(self) -> dict[str, float]:
        ready = sum(len(q) for q in self.queues)
        return {"async/buffer_fill": ready / (self.capacity * self.share * self.trainers),
                "async/prompts_in_flight": float(sum(self.running)),
                "async/dropped": float(self.dropped), "async/requeued_stale": float(self.requeued_stale),
                "async/requeued_rollback": float(self.requeued_rollback),
                "async/requeued_lost": float(self.requeued_lost)}


class BufferActor:
    """`ExperienceBuffer` as an asynchronous Ray actor shared by the makers and the trainer; it
    owns the run's prompt sampler (`prompts`: the training PromptSet, `sampler`: its sampler)."""

    def __init__(self, prompts, sampler, share: int, feeds: list, max_staleness: int, on_stale: str,
                 capacity: int, version: int):
        self.prompts, self.sampler = prompts, sampler
        self.buffer = ExperienceBuffer(share, [list(f) for f in feeds], self._draw, max_staleness, on_stale,
                                       capacity, version)
        self.changed: asyncio.Condition | None = None
        self.maker_versions: dict[int, int] = {}

    def _draw(self) -> list:
        return self.prompts.rows(self.sampler.next_indices())

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def lease(self, maker: int, most: int, maker_version: int, wait: bool = True) -> list[tuple[int, dict]]:
        """Up to `most` prompts for `maker` (its version: the larger of the one given and the last
        `set_maker_version`); with `wait`, waits until at least one is admitted, else answers at once."""
        changed = self._condition()
        async with changed:
            while True:
                version = max(maker_version, self.maker_versions.get(maker, maker_version))
                found = self.buffer.lease(maker, most, version)
                if found or not wait:
                    return found
                await changed.wait()

    async def set_maker_version(self, maker: int, version: int) -> None:
        changed = self._condition()
        async with changed:
            self.maker_versions[maker] = version
            changed.notify_all()

    async def put(self, groups: list[Group], maker=None, serial: int = 0) -> int:
        """Scored groups into their queues; with `maker` (its actor handle), their Batch is its put
        number `serial`, called for here so that this actor owns it (the module docstring)."""
        if maker is not None:
            ref = maker.hand_over.remote(serial)
            for g in groups:
                g.item[0] = ref
        changed = self._condition()
        async with changed:
            accepted = self.buffer.put(groups)
            changed.notify_all()
            return accepted

    async def take(self, trainer_version: int) -> list[list[Group]]:
        """The next `share` groups of every trainer (waits until each has them)."""
        changed = self._condition()
        async with changed:
            while True:
                found = self.buffer.take(trainer_version)
                changed.notify_all()  # the version moved, or requeued prompts: admissions may open
                if found is not None:
                    return found
                await changed.wait()

    async def give_back(self, taken: list[list[Group]], lost: list[tuple[int, int]]) -> int:
        changed = self._condition()
        async with changed:
            gone = self.buffer.give_back(taken, {tuple(x) for x in lost})
            changed.notify_all()
            return gone

    async def back_to(self, step: int, epoch: int) -> int:
        changed = self._condition()
        async with changed:
            back = self.buffer.back_to(step, epoch)
            changed.notify_all()
            return back

    def epoch(self) -> int:
        """The trainer's rollbacks so far: a new trainer's first is the next."""
        return self.buffer.epoch

    async def requeue(self, maker: int) -> int:
        changed = self._condition()
        async with changed:
            n = self.buffer.requeue(maker)
            self.maker_versions.pop(maker, None)
            changed.notify_all()
            return n

    def stats(self) -> dict[str, float]:
        return self.buffer.stats()

    async def snapshot(self) -> dict:
        """Everything a checkpoint needs, read at one instant: the sampler's state, the prompts to
        make again (being made, queued, drawn and not leased) and the ready groups with their
        experiences (fetched here, never by the driver's loop)."""
        b = self.buffer
        groups = [(d, g) for d, queue in enumerate(b.queues) for g in queue]
        state = {"sampler": self.sampler.state_dict(),
                 "rows": [b.leases[k].row for k in sorted(b.leases)] + list(b.rows) + list(b.drawn)}
        fetched = await settled([g for _, g in groups])
        lost = [g for _, g in groups if isinstance(fetched[id(g.item[0])], BaseException)]
        state["rows"] += [g.row for g in lost]  # made again on a resume (the trainer gives them back meanwhile)
        state["entries"] = [{"trainer": d, "version": g.version, "maker": g.maker, "tokens": g.tokens, "row": g.row,
                             "counts": g.counts, "batch": fetched[id(g.item[0])].index(slice(g.item[1], g.item[2]))}
                            for d, g in groups if not isinstance(fetched[id(g.item[0])], BaseException)]
        return state

    def restore(self, state: dict, version: int) -> None:
        """Start over at weight `version` from a checkpoint's snapshot, before any maker starts."""
        import ray

        b = self.buffer
        self.sampler.load_state_dict(state["sampler"])
        b.version, b.rows, b.drawn, b.leases = version, deque(state["rows"]), [], {}
        b.in_hand, b.last_taken = {}, version
        b.queues = [[] for _ in range(b.trainers)]
        b.accepted, b.running = [version * b.share] * b.trainers, [0] * b.trainers
        for e in state["entries"]:
            item = [ray.put(e["batch"]), 0, len(e["batch"])]
            b.queues[e["trainer"]].append(Group(item, e["version"], e["maker"], e["tokens"], e["row"],
                                                  counts=e.get("counts", {})))
            b.accepted[e["trainer"]] += 1


async def settled(groups: list[Group]) -> dict[int, Any]:
    """Each Batch the groups' rows live in, fetched once, by the id of its reference: the Batch, or
    the error of one gone (`ObjectLostError`: its node lost; `RayActorError`: its maker died before
    handing it over); any other error is raised."""
    import ray

    refs = list({id(g.item[0]): g.item[0] for g in groups}.values())
    results = await asyncio.gather(*refs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, (ray.exceptions.ObjectLostError,
                                                                ray.exceptions.RayActorError)):
            raise r
    return dict(zip(map(id, refs), results))


async def take_experience(buffer, version: int) -> tuple[list[list[Group]], list[list]]:
    """The trainer's take from the `BufferActor` `buffer` at weight `version`: per trainer, the groups
    taken and the Batch of each. A group whose experience is gone (`ObjectLostError`: its node lost;
    `RayActorError`: its maker died before handing it over) is given back with the rest of that take
    (`ExperienceBuffer.give_back`: its prompt made again) and the take is tried again, until every
    group taken arrives."""
    while True:
        taken = await buffer.take.remote(version)
        fetched = await settled([g for groups in taken for g in groups])
        lost = [(d, i) for d, groups in enumerate(taken) for i, g in enumerate(groups)
                if isinstance(fetched[id(g.item[0])], BaseException)]
        if not lost:
            return taken, [[fetched[id(g.item[0])].index(slice(g.item[1], g.item[2])) for g in groups]
                           for groups in taken]
        why = next(r for r in fetched.values() if isinstance(r, BaseException))
        gone = await buffer.give_back.remote(taken, lost)
        log.warning("%d experience group%s lost from the object store (%s); %s prompt%s queued to be made again",
                    gone, "s" if gone > 1 else "", type(why).__name__, "their" if gone > 1 else "its",
                    "s" if gone > 1 else "")
