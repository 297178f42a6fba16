"""The maker/trainer graph of an asynchronous run (`async.feeds`, `async.pushes`), checked.

ColossalChat names, per experience maker, the trainers it sends experience to, and per trainer,
the makers it sends weights to. xray's makers are the rollout's data-parallel replicas
(`maker0` .. `maker{rollout.dp - 1}`) and its trainers the actor's (`trainer0` ..
`trainer{actor.dp - 1}`). `feeds` maps a maker to the trainers it delivers to (each batch goes to
the one whose queue is shortest); a maker left out feeds every trainer. `pushes` maps a trainer
to the makers it updates; the trainers of one run hold the same weights, so each maker is updated
by exactly one trainer, and a maker left out is updated by trainer (maker index mod trainers).
`plan_run` checks the graph before anything starts; the async run reads it as index lists.
"""
from __future__ import annotations

from dataclasses import dataclass

from xray.config.typed import ConfigError


@dataclass(frozen=True)
class Graph:
    """Who feeds whom: `feeds[m]` the trainers maker m delivers to, `pusher[m]` the trainer that
    sends maker m its weights."""

    feeds: tuple[tuple[int, ...], ...]
    pusher: tuple[int, ...]

    @property
    def trainers(self) -> int:
        return 1 + max(t for targets in self.feeds for t in targets)

    def pushed_by(self, trainer: int) -> list[int]:
        """The makers `trainer` sends its weights to."""
        return [m for m, t in enumerate(self.pusher) if t == trainer]


def _index(name: str, kind: str, count: int, key: str) -> int:
    if not name.startswith(kind) or not name[len(kind):].isdigit() or int(name[len(kind):]) >= count:
        raise ConfigError(f"{key}: {name!r} is not one of {kind}0..{kind}{count - 1} "
                          f"({count} {kind}s: the {'rollout' if kind == 'maker' else 'actor'}'s dp)")
    return int(name[len(kind):])


def build_graph(feeds: dict[str, list[str]], pushes: dict[str, list[str]], makers: int, trainers: int) -> Graph:
    """The graph of `makers` makers and `trainers` trainers from the config's name lists; a
    ConfigError that says the fix when a name is unknown, a maker feeds nobody, a trainer is fed
    by nobody, or a maker is updated by two trainers."""
    fed = [tuple(range(trainers))] * makers
    for maker, targets in feeds.items():
        m = _index(maker, "maker", makers, "async.feeds")
        if not targets:
            raise ConfigError(f"async.feeds.{maker} is empty; name at least one trainer (trainer0..)")
        fed[m] = tuple(sorted({_index(t, "trainer", trainers, f"async.feeds.{maker}") for t in targets}))
    starved = sorted(set(range(trainers)) - {t for targets in fed for t in targets})
    if starved:
        raise ConfigError(f"async.feeds: trainer{starved[0]} is fed by no maker and would wait forever; "
                          "add it to a maker's list")
    pusher: list[int | None] = [None] * makers
    for trainer, targets in pushes.items():
        t = _index(trainer, "trainer", trainers, "async.pushes")
        for maker in targets:
            m = _index(maker, "maker", makers, f"async.pushes.{trainer}")
            if pusher[m] is not None:
                raise ConfigError(f"async.pushes: {maker} is updated by trainer{pusher[m]} and {trainer}; the "
                                  "trainers hold the same weights, so list each maker under one trainer")
            pusher[m] = t
    return Graph(tuple(fed), tuple(m % trainers if p is None else p for m, p in enumerate(pusher)))
