"""The replica of a run's in-memory snapshots on another node (`xray/run/checkpoints.py`).

A trained Workhorse hands its snapshot's files out as a call's answer, which the object store of
its own node keeps for the driver: it outlives the Workhorse's process, not its node. Where the
cluster has a node that runs none of the trained Workhorses, a `SnapshotHolder` actor there (the
driver's node when it is one of them) copies every snapshot into its own node's object store as
soon as it is handed out, and answers the references of its copies, which it owns: a snapshot is
complete once replicated, and losing the Workhorses' node loses none of it. On a single node there
is nowhere else to put it, and the driver's references are the copy.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class SnapshotHolder:
    """Ray actor (zero CPUs) that keeps copies of snapshot files on its node."""

    def copy(self, refs: list) -> list:
        """Copies, on this node, of the objects behind `refs` (passed in a list: not resolved by
        Ray); the references of the copies, owned by this actor."""
        import ray

        return [ray.put(value) for value in ray.get(refs)]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def start_holder(models: dict[str, Any]) -> Any | None:
    """A SnapshotHolder on a live node that runs none of `models`' Workhorses (the driver's first),
    or None when there is no such node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    used = set(ray.get([h.node_id.remote() for m in models.values() for h in m.shard_handles()]))
    driver = ray.get_runtime_context().get_node_id()
    free = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in used]
    if not free:
        return None
    node = driver if driver in free else free[0]
    holder = ray.remote(num_cpus=0)(SnapshotHolder).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    log.info("in-memory snapshots replicated to node %s (the trained Workhorses run on %d other node(s))",
             node[:8], len(used))
    return holder
