"""Finding the dead Workhorses of a run's models, the first thing every recovery does
(`xray/run/recovery/recover.py` for a step, `xray/run/detached/supervisor.py` for an asynchronous
run's makers and trainer).
"""
from __future__ import annotations


def dead_models(models) -> dict[str, list[int]]:
    """Role -> ranks whose Workhorse process is gone, for every model of the run with a death (the
    models are pinged at once: a busy one answers late, and the waits must not add up)."""
    from concurrent.futures import ThreadPoolExecutor

    roles = [r for r in ("actor", "critic", "reference", "teacher", "reward", "rollout")
             if getattr(models, r, None) is not None]
    with ThreadPoolExecutor(max_workers=len(roles)) as pool:
        found = dict(zip(roles, pool.map(lambda role: getattr(models, role).dead_ranks(), roles)))
    return {role: ranks for role, ranks in found.items() if ranks}
