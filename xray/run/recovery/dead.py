"""Finding the dead Workhorses of a run's models, the first thing every recovery does
(`xray/run/recovery/recover.py` for a step, `xray/run/detached/supervisor.py` for an asynchronous
run's makers and trainer).
"""
from __future__ import annotations

from xray.wholemodel.liveness import dead_shards

ROLES = ("actor", "critic", "reference", "teacher", "reward", "rollout")


def dead_models(models, wait_s: float = 1.0, settle_s: float = 0.2) -> dict[str, list[int]]:
    """Role -> ranks whose Workhorse process is gone, for every model of the run with a death: all
    pinged at once, a busy Workhorse counted alive, the answers read until `settle_s` after the last
    death seen or `wait_s` in all (`xray.wholemodel.liveness.dead_shards`)."""
    return dead_shards({role: getattr(models, role) for role in ROLES if getattr(models, role, None) is not None},
                       wait_s, settle_s)
