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
and the driver's references are the only copy. A model whose data-parallel replicas' files are
alike (Megatron: `Engine.replicas_identical`) and sit on several nodes needs no holder: each
rank's peer on another node holds its snapshot (`peers_elsewhere`), and a restore reads a lost
rank's file from a live peer (`live_peer`, `TrainEngine.as_rank`); no copy crosses a node. Of such
a model, in a synchronous run, only one rank per position hands its file out (`handers`, off the
driver's node): the others keep theirs in their process and hand it only to a restore whose
handed files were lost with their node (`FlashCheckpoints.materialize`); a lost keeper reads the
hander's file.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def dp_peers(parallel: Any, rank: int) -> list[int]:
    """The ranks of layout `parallel` (ParallelDims) at `rank`'s tensor and pipeline position in
    the other data-parallel replicas."""
    c = parallel.coords(rank)
    return [parallel.rank_of(c.tp_rank, c.pp_rank, d) for d in range(parallel.dp) if d != c.dp_rank]


def peers_elsewhere(parallel: Any, nodes: list[str]) -> bool:
    """Whether every rank (on `nodes[rank]`) has a data-parallel peer on another node: for a model
    whose replicas' files are alike (`Engine.replicas_identical`), the snapshot is then on two
    nodes already, and a holder's copy would be a third."""
    return len(set(nodes)) > 1 and all(any(nodes[p] != nodes[r] for p in dp_peers(parallel, r))
                                       for r in range(len(nodes)))


def live_peer(parallel: Any, nodes: list[str], alive: set[str], rank: int,
              usable: set[int] | None = None) -> int | None:
    """A data-parallel peer of `rank` on a live node (its file restores `rank`), among the ranks
    `usable` (None: any) whose file is there to read, or None."""
    return next((p for p in dp_peers(parallel, rank) if nodes[p] in alive and (usable is None or p in usable)), None)


def handers(parallel: Any, nodes: list[str], driver: str) -> list[int]:
    """The ranks that hand their snapshot to the object store when the data-parallel replicas are
    each other's copies: one per tensor and pipeline position, off the driver's node where one is
    (`driver`: the node whose cores the driver, the WholeModel actors and the rollout share); the
    others keep theirs in their process until a restore needs it (`FlashCheckpoints.materialize`)."""
    out = []
    for rank in range(len(nodes)):
        if parallel.coords(rank).dp_rank == 0:
            place = [rank, *dp_peers(parallel, rank)]
            out.append(next((r for r in place if nodes[r] != driver), rank))
    return sorted(out)


class SnapshotHolder:
    """Ray actor (zero CPUs) that pins copies of snapshot files in its node's object store."""

    def __init__(self) -> None:
        self.kept: dict[str, list] = {}

    def hold(self, items: dict[str, list], drop: list[str] = ()) -> dict[str, list]:
        """Release the copies under `drop` first, then for each name of `items`, read the objects
        behind its references (passed in a list: not resolved by Ray), put each into this node's
        object store as this holder's own object and keep those under the name; their
        references by name (in lists: handed back, not resolved)."""
        import ray

        self.drop(list(drop))
        out = {}
        for name, refs in items.items():
            replicas = []
            for ref in refs:  # one at a time: the read copy is freed before the next is read
                replicas.append(ray.put(ray.get(ref)))
            self.kept[name] = out[name] = replicas
        return out

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
        self.dropped: list[str] = []
        """The copies the holders release at the next `hold`."""

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

    async def hold(self, key: str, roles: dict[str, list]) -> dict[str, tuple[list[str], list]]:
        """Put a replica of each of the references of every role (rank order) on a node other than
        its rank's, under `key`: one call per holder, which first releases the snapshots `keep`
        let go; per role (each rank's node, each rank's replica reference, None where the holder
        was lost with its node: the ranks it was to copy sit elsewhere and live on)."""
        import asyncio

        by_node: dict[str, dict[str, list[int]]] = {}
        for role in roles:
            for rank, node in enumerate(self.nodes[role]):
                by_node.setdefault(self.target(node), {}).setdefault(role, []).append(rank)
        self.held.add(key)
        drop, self.dropped = self.dropped, []
        self._drop(drop, skip=set(by_node))  # the holders with no copy to make this time
        answers = await asyncio.gather(*[
            self.holders[n].hold.remote({f"{key}/{role}": [roles[role][r] for r in ranks] for role, ranks in picks.items()},
                                        drop) for n, picks in by_node.items()], return_exceptions=True)
        out = {role: (list(self.nodes[role]), [None] * len(refs)) for role, refs in roles.items()}
        for (node, picks), copies in zip(by_node.items(), answers):
            if isinstance(copies, BaseException):  # that holder's node left: those ranks keep no replica
                log.warning("in-memory snapshot %s: ranks %s have no replica (the holder on node %s is lost: %s)",
                            key, picks, node[:8], str(copies).splitlines()[0][:200])
                continue
            for role, ranks in picks.items():
                for rank, copy in zip(ranks, copies[f"{key}/{role}"]):
                    out[role][1][rank] = copy
        return out

    def release(self) -> None:
        """Send the holders the releases `keep` left for the next `hold`, when no `hold` follows
        (every role's copies are its peers)."""
        drop, self.dropped = self.dropped, []
        self._drop(drop)

    def _drop(self, drop: list[str], skip: set[str] = frozenset()) -> None:
        """Have every holder but those on the nodes in `skip` (their `hold` carries it) release
        the copies named in `drop`."""
        for node, holder in self.holders.items() if drop else ():
            if node not in skip:
                holder.drop.remote(drop)

    @staticmethod
    def alive() -> set[str]:
        """The nodes alive now."""
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def keep(self, keys: list[str]) -> None:
        """The holders release the copies of the snapshots older than the newest of `keys` that are
        not among them (a newer one being copied stays), at their next `hold`: no call of its own."""
        newest = max(keys, default="")
        dropped = sorted(k for k in self.held if k < newest and k not in keys)
        self.held -= set(dropped)
        self.dropped += [f"{key}/{role}" for key in dropped for role in self.nodes]
