"""The replicas of a run's in-memory snapshots, each on a node other than its shard's (`xray/run/checkpoints.py`).

A trained Workhorse hands its snapshot's files out as a call's answer (tensors as numpy arrays,
`xray.backends.snapshot.to_wire`), which the object store of its own node keeps for the driver:
it outlives the Workhorse's process, not its node. A `SnapshotHolder` actor (zero CPUs) on every
node of the cluster reads the answers of shards on other nodes (the driver's node's holder first)
and keeps what it read: the read maps the arrays without copying them, so it pins a second copy
of each answer in its node's object store for as long as the snapshot may be restored. When a
shard's node is lost, Ray reads that copy for the same reference (its owner, the driver, makes
the copy the primary one), and losing any one node loses none of a snapshot. On a single node
there is nowhere else to put them, and the driver's references are the only copy.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class SnapshotHolder:
    """Ray actor (zero CPUs) that pins copies of snapshot files in its node's object store."""

    def __init__(self) -> None:
        self.kept: dict[str, list] = {}

    def hold(self, key: str, refs: list) -> int:
        """Read the objects behind `refs` (passed in a list: not resolved by Ray) into this node's
        object store and keep them under `key`; the number held."""
        import ray

        self.kept[key] = ray.get(refs)
        return len(refs)

    def drop(self, keys: list[str]) -> None:
        """Release the copies under `keys`."""
        for key in keys:
            self.kept.pop(key, None)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def warm(self) -> None:
        """Quiet the libraries' start-up noise as a Workhorse does (reading a DeepSpeed snapshot
        imports DeepSpeed), and import what reading any snapshot imports, ahead of the first copy."""
        from xray.workhorse.quiet import install_filters

        install_filters()
        import xray.backends.snapshot  # noqa: F401 - WireTensor, and torch


class Replicator:
    """A `SnapshotHolder` on every live node (started as nodes appear, and warmed: the first copy
    need not wait for torch's import), and the node of every trained shard; `hold` pins a copy of
    a model's answers, each on a node other than its shard's."""

    def __init__(self) -> None:
        import ray

        self.holders: dict[str, Any] = {}
        """Live node -> its holder."""
        self.nodes: dict[str, list[str]] = {}
        """Role -> each rank's node (looked up again when the models move)."""
        self.driver = ray.get_runtime_context().get_node_id()
        self.held: set[str] = set()
        """The snapshots (keys, sortable by step) whose copies the holders keep."""

    def refresh(self, models: dict[str, Any] | None = None) -> int:
        """Start holders on nodes that joined, forget those of nodes that left, and with `models`
        (role -> WholeModel) look their shards' nodes up again; the number of live nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from xray.workhorse.quiet import workhorse_env

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        self.holders = {n: h for n, h in self.holders.items() if n in alive}
        for node in sorted(alive - set(self.holders)):
            holder = self.holders[node] = ray.remote(num_cpus=0)(SnapshotHolder).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": workhorse_env("CPU")}).remote()  # it computes nothing
            holder.warm.remote()
            log.info("in-memory snapshot replicas: a holder on node %s", node[:8])
        if models is not None:
            self.nodes = {role: ray.get([h.node_id.remote() for h in m.shard_handles()]) for role, m in models.items()}
        return len(alive)

    def target(self, node: str) -> str:
        """The node that holds the copy of a shard on `node`: the driver's, or another one."""
        return self.driver if self.driver != node and self.driver in self.holders else \
            next(n for n in sorted(self.holders) if n != node)

    async def hold(self, key: str, role: str, refs: list) -> None:
        """Pin a copy of each of `refs` (rank order) on a node other than its rank's, under `key`."""
        import asyncio

        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes[role]):
            by_node.setdefault(self.target(node), []).append(rank)
        self.held.add(key)
        await asyncio.gather(*[self.holders[n].hold.remote(f"{key}/{role}", [refs[r] for r in ranks])
                               for n, ranks in by_node.items()])

    def keep(self, keys: list[str]) -> None:
        """Every holder releases the copies of the snapshots older than the newest of `keys` that
        are not among them (a newer one being copied stays)."""
        newest = max(keys, default="")
        dropped = sorted(k for k in self.held if k < newest and k not in keys)
        self.held -= set(dropped)
        names = [f"{key}/{role}" for key in dropped for role in self.nodes]
        for holder in self.holders.values():
            if names:
                holder.drop.remote(names)
