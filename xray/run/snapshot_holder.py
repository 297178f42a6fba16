"""The replicas of a run's in-memory snapshots, each on a node other than its shard's (`xray/run/checkpoints.py`).

A trained Workhorse hands its snapshot's files out as a call's answer, which the object store of
its own node keeps for the driver: it outlives the Workhorse's process, not its node. A
`SnapshotHolder` actor (zero CPUs) on every node of the cluster copies into its own node's object
store the answers of Workhorses that run on another node (the driver's node's holder first), and
answers the references of its copies, which it owns. A snapshot is complete once every shard's
answer is replicated so, and losing any one node loses none of it: a shard's files are then read
from the original or the copy, whichever lives (`TrainWorkhorse.load`). On a single node there is
nowhere else to put them, and the driver's references are the only copy.
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

    def warm(self) -> None:
        """Import what unpickling a snapshot imports (torch; DeepSpeed where installed), ahead of the
        first copy."""
        import importlib.util

        import torch  # noqa: F401

        if importlib.util.find_spec("deepspeed") is not None:
            import deepspeed  # noqa: F401


class Replicator:
    """A `SnapshotHolder` on every live node (started as nodes appear, and warmed: the first copy
    need not wait for torch's import), and the node of every trained shard; `copy` replicates a
    model's answers, each to a node other than its shard's."""

    def __init__(self) -> None:
        import ray

        self.holders: dict[str, Any] = {}
        """Live node -> its holder."""
        self.nodes: dict[str, list[str]] = {}
        """Role -> each rank's node (None: to be looked up again, the models moved)."""
        self.driver = ray.get_runtime_context().get_node_id()

    def refresh(self, models: dict[str, Any] | None = None) -> int:
        """Start holders on nodes that joined, forget those of nodes that left, and with `models`
        (role -> WholeModel) look their shards' nodes up again; the number of live nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        self.holders = {n: h for n, h in self.holders.items() if n in alive}
        for node in sorted(alive - set(self.holders)):
            holder = self.holders[node] = ray.remote(num_cpus=0)(SnapshotHolder).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            holder.warm.remote()
            log.info("in-memory snapshot replicas: a holder on node %s", node[:8])
        if models is not None:
            self.nodes = {role: ray.get([h.node_id.remote() for h in m.shard_handles()]) for role, m in models.items()}
        return len(alive)

    def target(self, node: str) -> str:
        """The node that holds the copy of a shard on `node`: the driver's, or another one."""
        return self.driver if self.driver != node and self.driver in self.holders else \
            next(n for n in sorted(self.holders) if n != node)

    async def copy(self, role: str, refs: list) -> list:
        """References of copies of `refs` (rank order), each on a node other than its rank's."""
        import asyncio

        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes[role]):
            by_node.setdefault(self.target(node), []).append(rank)
        copied = await asyncio.gather(*[self.holders[n].copy.remote([refs[r] for r in ranks])
                                        for n, ranks in by_node.items()])
        out: list = [None] * len(refs)
        for ranks, copies in zip(by_node.values(), copied):
            for rank, ref in zip(ranks, copies):
                out[rank] = ref
        return out
