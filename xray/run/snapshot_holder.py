"""The replicas of a run's in-memory snapshots, each on a node other than its shard's (`xray/run/checkpoints.py`).

A trained Workhorse hands its snapshot's files out as a call's answer (tensors as numpy arrays,
`xray.backends.snapshot.to_wire`), which the object store of its own node keeps for the driver:
it outlives the Workhorse's process, not its node. A `SnapshotHolder` actor (zero CPUs) on every
node of the cluster reads the answers of shards on other nodes (the driver's node's holder first),
puts each one in its node's object store as an object of its own, and hands back the references
of those replicas, keeping them for as long as the snapshot may be restored. When a shard's node
is lost, a restore reads that shard's replica (`FlashCheckpoints.held_for` picks, for each rank,
the original while its node lives, else the replica), and losing any one node loses none of a
snapshot. The replica is the holder's own object, not a second location of the driver's: reading
it does not depend on Ray promoting a copy of a lost object. On a single node there is nowhere else to put them,
and the driver's references are the only copy.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class SnapshotHolder:
    """Ray actor (zero CPUs) that pins copies of snapshot files in its node's object store."""

    def __init__(self) -> None:
        self.kept: dict[str, list] = {}

    def hold(self, key: str, refs: list) -> list:
        """Read the objects behind `refs` (passed in a list: not resolved by Ray), put each into
        this node's object store as this holder's own object, keep those under `key` and return
        their references (in a list: handed back, not resolved)."""
        import ray

        replicas = []
        for ref in refs:  # one at a time: the read copy is freed before the next is read
            replicas.append(ray.put(ray.get(ref)))
        self.kept[key] = replicas
        return replicas

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
        """Start holders on nodes that joined (none while the cluster has one node: a holder is a
        process with torch imported, ~0.3 GB), forget those of nodes that left, and with `models`
        (role -> WholeModel) look their shards' nodes up again; the number of live nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from xray.workhorse.quiet import workhorse_env

        alive = self.alive()
        self.holders = {n: h for n, h in self.holders.items() if n in alive}
        for node in sorted(alive - set(self.holders)) if len(alive) > 1 else []:  # one node: no copy to make
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

    async def hold(self, key: str, role: str, refs: list) -> tuple[list[str], list]:
        """Put a replica of each of `refs` (rank order) on a node other than its rank's, under
        `key`; (each rank's node, each rank's replica reference, None where the holder was lost
        with its node: the ranks it was to copy sit elsewhere and live on)."""
        import asyncio

        nodes = list(self.nodes[role])
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            by_node.setdefault(self.target(node), []).append(rank)
        self.held.add(key)
        answers = await asyncio.gather(*[self.holders[n].hold.remote(f"{key}/{role}", [refs[r] for r in ranks])
                                         for n, ranks in by_node.items()], return_exceptions=True)
        replicas: list = [None] * len(refs)
        for (node, ranks), copies in zip(by_node.items(), answers):
            if isinstance(copies, BaseException):  # that holder's node left: those ranks keep no replica
                log.warning("in-memory snapshot %s: %s's ranks %s have no replica (the holder on node %s is "
                            "lost: %s)", key, role, ranks, node[:8], str(copies).splitlines()[0][:200])
                continue
            for rank, copy in zip(ranks, copies):
                replicas[rank] = copy
        return nodes, replicas

    @staticmethod
    def alive() -> set[str]:
        """The nodes alive now."""
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

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
