"""The experience buffer of asynchronous PPO: makers put experience batches, trainers take them.

It holds object references, never the experiences themselves (they stay in Ray's object store
where the maker put them): one queue per trainer (data-parallel replica of the actor). A maker
claims a place before it samples (`Detached.claim`): trainer `d` and index `j`, the trainer step
that will train on the batch; a trainer step takes, from every queue, the entry with the next
index, so batches are trained in the order they were claimed, whatever order they finish in.
An entry records the weight version that generated it and the maker that made it; when the
trainers, at weight version `t`, take an entry of version `v`, its staleness is `t - v`. An entry
over `max_staleness` is dropped and counted, and the next index takes its place (`on_stale: drop`;
with `wait` makers claim only what will be fresh enough, and nothing is dropped). `ExperienceBuffer`
is the policy, plain and unit-tested; `BufferActor` serves it as an asynchronous Ray actor whose
`take` waits until every queue has its next entry. A checkpoint reads every entry (`snapshot`)
and a resume puts them back (`restore`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


def maker_must_wait(on_stale: str, index: int, maker_version: int, max_staleness: int) -> bool:
    """`on_stale: wait`: a maker waits for new weights while a batch it sampled now for trainer
    step `index` (trained from version `index - 1`) would be too stale then. `drop`: makers never
    wait (the buffer drops instead)."""
    return on_stale == "wait" and index - 1 - maker_version > max_staleness


@dataclass(frozen=True)
class Entry:
    """One experience batch in a queue."""

    item: Any
    """What the maker put (a list holding the batch's object reference)."""
    version: int
    """The weight version that generated it."""
    maker: int
    serial: int
    """The run's count of batches begun: identifies the batch across a checkpoint."""
    index: int = 0
    """Its place in its trainer's queue: the trainer step claimed for it."""


@dataclass
class ExperienceBuffer:
    """Per-trainer queues of entries by index; drops counted."""

    capacity: int
    """Entries each trainer's queue holds (the makers' claims keep within it)."""
    max_staleness: int
    trainers: int = 1
    first: int = 1
    """The index the trainers take first (the step after the run's start or resume)."""
    queues: list = field(default_factory=list)
    expected: list = field(default_factory=list)
    """Per queue, the index its next take needs."""
    dropped: int = 0
    """Entries discarded for being too stale when taken."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_staleness < 0 or self.trainers < 1:
            raise ValueError(f"capacity={self.capacity} and trainers={self.trainers} must be >= 1 and "
                             f"max_staleness={self.max_staleness} >= 0")
        self.queues = [{} for _ in range(self.trainers)]
        self.expected = [self.first] * self.trainers

    def put(self, entry: Entry, trainer: int) -> None:
        """Queue `entry` for `trainer` at its claimed index."""
        queue = self.queues[trainer]
        if len(queue) >= self.capacity:
            raise RuntimeError(f"trainer {trainer}'s queue is full ({self.capacity}); claim a place before sampling")
        if entry.index < self.expected[trainer] or entry.index in queue:
            raise RuntimeError(f"index {entry.index} of trainer {trainer} is taken or already trained on")
        queue[entry.index] = entry

    def take(self, trainer_version: int) -> tuple[list[tuple[Entry, int]] | None, list[int]]:
        """(The next entry of every queue with its staleness, in trainer order, or None (nothing
        taken) while a queue's next entry is missing; per queue, the entries dropped now). Too-stale
        entries are dropped and the next index takes their place."""
        dropped = [0] * self.trainers
        for d, queue in enumerate(self.queues):
            while self.expected[d] in queue and trainer_version - queue[self.expected[d]].version > self.max_staleness:
                del queue[self.expected[d]]
                self.expected[d] += 1
                dropped[d] += 1
        self.dropped += sum(dropped)
        if not all(e in q for e, q in zip(self.expected, self.queues)):
            return None, dropped
        taken = []
        for d, queue in enumerate(self.queues):
            entry = queue.pop(self.expected[d])
            self.expected[d] += 1
            taken.append((entry, trainer_version - entry.version))
        return taken, dropped

    def entries(self) -> list[tuple[int, Entry]]:
        """Every queued entry with its trainer, in index order per queue."""
        return [(d, queue[i]) for d, queue in enumerate(self.queues) for i in sorted(queue)]

    def stats(self) -> dict[str, float]:
        fill = sum(len(q) for q in self.queues) / (self.capacity * self.trainers)
        return {"async/buffer_fill": fill, "async/dropped": self.dropped}


class BufferActor:
    """`ExperienceBuffer` as an asynchronous Ray actor shared by makers and the trainers."""

    def __init__(self, capacity: int, max_staleness: int, trainers: int = 1, first: int = 1):
        self.buffer = ExperienceBuffer(capacity, max_staleness, trainers, first)
        self.changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def put(self, entry: Entry, trainer: int) -> None:
        changed = self._condition()
        async with changed:
            self.buffer.put(entry, trainer)
            changed.notify_all()

    async def take(self, trainer_version: int) -> tuple[list[tuple[Entry, int]], list[int]]:
        """The next entry of every queue (waits until each has it), and the drops per queue."""
        changed = self._condition()
        dropped = [0] * self.buffer.trainers
        async with changed:
            while True:
                found, now = self.buffer.take(trainer_version)
                dropped = [a + b for a, b in zip(dropped, now)]
                if found is not None:
                    return found, dropped
                await changed.wait()

    def snapshot(self) -> list[tuple[int, Entry]]:
        """Every queued entry with its trainer (for a checkpoint; nothing is removed)."""
        return self.buffer.entries()

    def restore(self, entries: list[tuple[int, Entry]], first: int) -> None:
        """Start over at index `first` with a checkpoint's entries (given their new indices),
        before any maker starts."""
        self.buffer.queues = [{} for _ in range(self.buffer.trainers)]
        self.buffer.expected = [first] * self.buffer.trainers
        for trainer, entry in entries:
            self.buffer.put(entry, trainer)

    def stats(self) -> dict[str, float]:
        return self.buffer.stats()
