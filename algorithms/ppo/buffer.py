"""The experience buffer of asynchronous PPO: makers put experience batches, the trainer takes them.

It holds object references, never the experiences themselves (they stay in Ray's object store
where the maker put them), with a capacity and a staleness bound. An entry records the weight
version that generated it; when the trainer, at weight version `t`, takes the oldest entry of
version `v`, its staleness is `t - v`. An entry over `max_staleness` is dropped and counted (it
can only happen when the buffer held it while the trainer moved on). `ExperienceBuffer` is the
policy, plain and unit-tested; `BufferActor` serves it as an asynchronous Ray actor whose `put`
waits while the buffer is full and whose `take` waits while it is empty.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any


def maker_must_wait(on_stale: str, trainer_version: int, maker_version: int, max_staleness: int) -> bool:
    """`on_stale: wait`: a maker waits for new weights while anything it sampled now would already be
    too stale for the trainer. `drop`: makers never wait (the buffer drops instead)."""
    return on_stale == "wait" and trainer_version - maker_version > max_staleness


@dataclass
class ExperienceBuffer:
    """Entries in arrival order with their weight versions; drops and waits counted."""

    capacity: int
    max_staleness: int
    entries: deque = field(default_factory=deque)
    dropped: int = 0
    """Entries discarded for being too stale when taken."""
    full_waits: int = 0
    """Makers that found the buffer full and waited for room before sampling."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_staleness < 0:
            raise ValueError(f"capacity={self.capacity} must be >= 1 and max_staleness={self.max_staleness} >= 0")

    def full(self) -> bool:
        return len(self.entries) >= self.capacity

    def put(self, item: Any, version: int) -> None:
        if self.full():
            raise RuntimeError("put on a full buffer; wait until it has room")
        self.entries.append((item, version))

    def take(self, trainer_version: int) -> tuple[Any, int, int] | None:
        """The oldest entry fresh enough for `trainer_version`: (item, version, staleness); None
        when none is left (too-stale entries on the way are dropped and counted)."""
        while self.entries:
            item, version = self.entries.popleft()
            staleness = trainer_version - version
            if staleness <= self.max_staleness:
                return item, version, staleness
            self.dropped += 1
        return None

    def stats(self) -> dict[str, float]:
        return {"async/buffer_fill": len(self.entries) / self.capacity, "async/dropped": self.dropped,
                "async/buffer_full_waits": self.full_waits}


class BufferActor:
    """`ExperienceBuffer` as an asynchronous Ray actor shared by makers and the trainer."""

    def __init__(self, capacity: int, max_staleness: int):
        self.buffer = ExperienceBuffer(capacity, max_staleness)
        self.changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def put(self, item: Any, version: int) -> None:
        """Add an entry (`item`: a list holding the experience's object ref); waits while full."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: not self.buffer.full())
            self.buffer.put(item, version)
            changed.notify_all()

    async def room(self) -> None:
        """Wait until the buffer has room (makers ask before sampling, so batches do not age here)."""
        changed = self._condition()
        async with changed:
            if self.buffer.full():
                self.buffer.full_waits += 1
            await changed.wait_for(lambda: not self.buffer.full())

    async def take(self, trainer_version: int) -> tuple[Any, int, int]:
        """The next entry fresh enough for `trainer_version`; waits until there is one."""
        changed = self._condition()
        async with changed:
            while True:
                found = self.buffer.take(trainer_version)
                changed.notify_all()
                if found is not None:
                    return found
                await changed.wait()

    def stats(self) -> dict[str, float]:
        return self.buffer.stats()
