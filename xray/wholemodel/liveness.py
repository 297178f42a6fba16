"""Which Workhorses of some WholeModels are dead: one ping each, read as Ray answers.

Sits under `WholeModel.dead_ranks` (one model) and a run's recovery (`xray.run.recovery.dead`:
every model of the run at once, so that the waits do not add up).
"""
from __future__ import annotations

import time
from typing import Any


def dead_shards(models: dict[str, Any], wait_s: float = 1.0, settle_s: float = 0.2) -> dict[str, list[int]]:
    """Name -> ranks whose Workhorse process is gone, for each of `models` (name -> WholeModel)
    with a death.

    Every Workhorse is pinged at once; a dead one's ping fails as soon as Ray knows of the death, a
    busy live one answers only when its call ends and counts as alive. The answers are read until
    all are in, or `settle_s` after the last death seen (the Workhorses of a lost node die together,
    and Ray reports them together), or `wait_s` in all: a recovery waits for a death a fifth of a
    second, not the second a busy Workhorse would take (when none is seen, the caller's failure was
    no death, and it waits the whole `wait_s`)."""
    import ray
    from ray.exceptions import RayActorError

    pings = {ref: (name, rank) for name, model in models.items()
             for rank, ref in enumerate(s.pid.remote() for s in model.shard_handles())}
    dead: dict[str, list[int]] = {}
    pending = list(pings)
    end = deadline = time.monotonic() + wait_s
    while pending and (left := end - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                name, rank = pings[ref]
                dead.setdefault(name, []).append(rank)
                end = min(deadline, time.monotonic() + settle_s)
    return {name: sorted(ranks) for name, ranks in dead.items()}
