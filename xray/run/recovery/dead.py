"""Finding the dead Workhorses of a run's models, the first thing every recovery does
(`xray/run/recovery/recover.py` for a step, `xray/run/detached/supervisor.py` for an asynchronous
run's makers and trainer).
"""
from __future__ import annotations

ROLES = ("actor", "critic", "reference", "teacher", "reward", "rollout")


def dead_models(models, wait_s: float = 1.0, settle_s: float = 0.2) -> dict[str, list[int]]:
    """Role -> ranks whose Workhorse process is gone, for every model of the run with a death.

    Every Workhorse of every model is pinged at once; a dead one's ping fails as soon as Ray knows
    of the death, a busy live one answers only when its call ends and counts as alive. The answers
    are read until all are in, or `settle_s` after the last death seen (the Workhorses of a lost
    node die together, and Ray reports them together), or `wait_s` in all: a recovery waits for a
    death a fifth of a second, not the second a busy Workhorse would take (when none is seen, the
    caller's failure was no death, and it waits the whole `wait_s`)."""
    import time

    import ray
    from ray.exceptions import RayActorError

    pings = {ref: (role, rank) for role in ROLES if getattr(models, role, None) is not None
             for rank, ref in enumerate(s.pid.remote() for s in getattr(models, role).shard_handles())}
    dead: dict[str, list[int]] = {}
    pending = list(pings)
    end = deadline = time.monotonic() + wait_s
    while pending and (left := end - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left, fetch_local=False)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                role, rank = pings[ref]
                dead.setdefault(role, []).append(rank)
                end = min(deadline, time.monotonic() + settle_s)
    return {role: sorted(ranks) for role, ranks in dead.items()}
