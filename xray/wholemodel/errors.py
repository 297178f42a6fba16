"""The errors a WholeModel call raises: one error for many failing shards, deadlines, dead shards.

Shards that fail with the same message are grouped, so 64 identical failures read as one line
naming 64 ranks; the first traceback is kept in full.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardFailure:
    """What one shard reported."""

    rank: int
    message: str
    """`ExceptionType: text`, the last line of the shard's traceback."""
    traceback: str
    """The shard's formatted traceback (as Ray relays it)."""


class WholeModelError(RuntimeError):
    """A call failed on one or more shards; `ranks` lists them."""

    def __init__(self, role: str, method: str, failures: list[ShardFailure], world_size: int):
        self.role, self.method, self.failures = role, method, sorted(failures, key=lambda f: f.rank)
        self.ranks = [f.rank for f in self.failures]
        groups: dict[str, list[int]] = {}
        for f in self.failures:
            groups.setdefault(f.message, []).append(f.rank)
        lines = [f"{role}.{method} failed on {len(self.ranks)} of {world_size} shards (ranks {self.ranks}):"]
        lines += [f"  ranks {ranks}: {msg}" for msg, ranks in groups.items()]
        first = self.failures[0]
        lines.append(f"first traceback (rank {first.rank}):\n{first.traceback}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (_rebuild, (type(self), self.role, self.method, self.failures, self._world_size()))

    def _world_size(self) -> int:
        head = str(self).split("\n", 1)[0]
        return int(head.split(" of ")[1].split(" ")[0])


def _rebuild(cls, role, method, failures, world_size):
    return cls(role, method, failures, world_size)


class WorkhorseDied(WholeModelError):
    """A shard's process is gone; the WholeModel cannot serve calls until it is rebuilt."""


class CallDeadlineExceeded(RuntimeError):
    """A call did not finish within its deadline; `ranks` lists the unfinished shards."""

    def __init__(self, role: str, method: str, deadline_s: float, ranks: list[int]):
        self.role, self.method, self.deadline_s, self.ranks = role, method, deadline_s, ranks
        super().__init__(f"{role}.{method} passed its deadline of {deadline_s:g} s; unfinished shards: "
                         f"ranks {ranks}. Raise the deadline (deadline_s=...) if the work is expected "
                         "to take longer, or look for a hang on those ranks")

    def __reduce__(self):
        return (CallDeadlineExceeded, (self.role, self.method, self.deadline_s, self.ranks))


