"""Reserving devices on the Ray cluster: one placement group per node pack of a device group.

A device group of the config is reserved as bundles, one per rank (a GPU, or a CPU slot of
`threads` CPUs), split into node packs (`xray/config/packing.py`: the devices of each model
replica, and of the colocated roles' replicas that overlap it). Each pack is one placement group
with strategy STRICT_PACK, so Ray puts all of a pack on one node: the tensor- and
pipeline-parallel peers of a replica never straddle nodes, while different packs go wherever
there is room (a group larger than a node spans nodes, one whole replica per node at least).
Every role placed on a group gets the same bundles, and its Workhorses take `1 / (roles in the
group)` of each (colocation).

A `Bundles` is what a WholeModel is handed (`xray/wholemodel/handle.py`): each rank's bundle.

Ray, not the config, picks the node of each pack and the device of each Workhorse on it (it sets
CUDA_VISIBLE_DEVICES): a group's `ranks` count its devices. Custom `resources` pin a group to the
nodes started with them.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from xray.config.packing import Packs

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot offer the devices a placement asks for."""


@dataclass(frozen=True)
class Bundles:
    """Where a WholeModel's Workhorses go: one placement-group bundle per rank, in one placement
    group or in several (`groups`: one per node pack, `reserve`)."""

    placement_group: Any
    """The placement group of every rank; with `groups`, that of rank 0."""
    indices: tuple[int, ...]
    """Each rank's bundle index in its placement group."""
    share: int = 1
    """How many roles share these devices (colocation): each Workhorse takes 1/share of one."""
    groups: tuple[Any, ...] = ()
    """Each rank's placement group, when the ranks' bundles are in several; empty: all in `placement_group`."""

    def __post_init__(self) -> None:
        if self.groups and len(self.groups) != len(self.indices):
            raise ValueError(f"{len(self.groups)} placement groups given for {len(self.indices)} bundle indices; "
                             "give one per rank")

    def slots(self) -> list[tuple[Any, int]]:
        """(placement group, bundle index) of each rank."""
        return list(zip(self.groups or [self.placement_group] * len(self.indices), self.indices))

    def placement_groups(self) -> list[Any]:
        """The distinct placement groups, in rank order."""
        return list({id(pg): pg for pg in (self.groups or (self.placement_group,))}.values())

    def release(self) -> None:
        """Give every placement group back to the cluster."""
        import ray

        for pg in self.placement_groups():
            ray.util.remove_placement_group(pg)


def device_bundle(device: str, threads: int = 1, resources: tuple = ()) -> dict[str, float]:
    """What one device of a group reserves: a GPU or `threads` CPUs, and its custom resources."""
    return {**({"GPU": 1} if device.upper() == "GPU" else {"CPU": threads}), **dict(resources)}


def free_per_node(device: str, threads: int = 1, resources: tuple = (), exclude: Sequence[str] = ()) -> dict[str, int]:
    """Node id -> how many more such devices it has unreserved now, for the nodes that have some,
    leaving out the nodes in `exclude` (draining ones): an estimate that a reservation confirms."""
    from ray._private.state import available_resources_per_node  # Ray's own per-node view

    need = device_bundle(device, threads, resources)
    counts = {node: int(min(have.get(k, 0.0) // v for k, v in need.items()))
              for node, have in available_resources_per_node().items() if node not in exclude}
    return {node: n for node, n in counts.items() if n > 0}


def free_devices(device: str, threads: int = 1, resources: tuple = (), exclude: Sequence[str] = ()) -> int:
    """How many more such devices the cluster has unreserved now (`free_per_node`, summed)."""
    return sum(free_per_node(device, threads, resources, exclude).values())


def hosting_nodes(device: str, threads: int = 1, resources: tuple = ()) -> tuple[str, ...]:
    """The ids of the alive nodes that hold at least one such device (reserved or not): where a
    group of them may be placed, and so where its standby processes wait (`xray/wholemodel/standby.py`)."""
    import ray

    need = device_bundle(device, threads, resources)
    return tuple(sorted(n["NodeID"] for n in ray.nodes()
                        if n["Alive"] and all(n["Resources"].get(k, 0.0) >= v for k, v in need.items())))


def head_node() -> str | None:
    """The Ray head node's id (the node holding Ray's head-only resource)."""
    import ray

    return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]), None)


def drain_node(node_id: str, deadline_s: float, why: str) -> bool:
    """Tell Ray that node `node_id` drains (a preemption notice): nothing new is placed there and
    its devices stop counting as free, while what runs there goes on until it leaves, up to
    `deadline_s` seconds from now. Whether Ray accepted (it refuses the head node)."""
    import time

    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, reason = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                      why, int((time.time() + deadline_s) * 1000))
    if not accepted:
        log.warning("Ray refused to drain node %s: %s", node_id[:8], reason)
    return bool(accepted)


def pack_slots(count: int, packs: Packs) -> list[tuple[int, int]]:
    """(pack number, bundle index in that pack's placement group) of each of `count` ranks."""
    slots: dict[int, tuple[int, int]] = {}
    for n, pack in enumerate(packs):
        for i, rank in enumerate(pack):
            slots[rank] = (n, i)
    if sorted(slots) != list(range(count)):
        raise ValueError(f"packs {packs} do not hold each of the {count} ranks exactly once")
    return [slots[r] for r in range(count)]


def standing(bundles: Bundles, exclude: Sequence[str] = ()) -> list[Any]:
    """The placement groups of `bundles` that still hold all their devices: created, every bundle on
    an alive node outside `exclude` (draining ones). An elastic resize keeps them, and the
    Workhorses in them keep their processes (`xray/run/models.py`)."""
    import ray
    from ray.util import placement_group_table

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - set(exclude)
    out = []
    for pg in bundles.placement_groups():
        table = placement_group_table(pg)
        nodes = set(table.get("bundles_to_node_id", {}).values())
        if table.get("state") == "CREATED" and nodes and nodes <= alive:
            out.append(pg)
    return out


def reserve(name: str, count: int, device: str, threads: int = 1, timeout_s: float = 120.0,
            share: int = 1, resources: tuple = (), packs: Packs | None = None, keep: Sequence[Any] = ()) -> Bundles:
    """`count` devices, one STRICT_PACK placement group per pack of `packs` (default: one per
    device); waits until the cluster grants them all, or frees them and raises PlacementError.
    `keep`: placement groups reserved before (`standing`) that serve again, in order, for packs of
    their size; only the others are reserved (and freed on failure)."""
    import ray
    from ray.util.placement_group import placement_group

    packs = packs if packs is not None else tuple((i,) for i in range(count))
    slots = pack_slots(count, packs)
    bundle = device_bundle(device, threads, resources)
    tag = uuid.uuid4().hex[:8]  # unique: runs and models coexist
    spare = list(keep)
    pgs = []
    for n, pack in enumerate(packs):
        old = next((pg for pg in spare if pg.bundle_count == len(pack)), None)
        if old is not None:
            spare.remove(old)
        pgs.append(old or placement_group([dict(bundle) for _ in pack], strategy="STRICT_PACK",
                                          name=f"xray-{name}-{tag}-{n}"))
    new = [pg for pg in pgs if not any(pg is k for k in keep)]
    ready, _ = ray.wait([pg.ready() for pg in new], num_returns=len(new), timeout=timeout_s) if new else ([], [])
    if len(ready) < len(new):
        for pg in new:
            ray.util.remove_placement_group(pg)
        have = ray.cluster_resources()
        raise PlacementError(
            f"device group {name!r} asks for {count} x {bundle} in packs of {sorted({len(p) for p in packs})} "
            f"devices, each pack on one node, and the cluster did not grant it in {timeout_s:g} s (cluster "
            f"resources: {have}); free devices, add nodes, lower the group's ranks, or check that each node "
            "offers nproc_per_node devices")
    groups = tuple(pgs[n] for n, _ in slots)
    return Bundles(groups[0], tuple(i for _, i in slots), share, groups if len(pgs) > 1 else ())


def reserve_plan(plan, threads: int = 1) -> dict[str, Bundles]:
    """Bundles for every role of a `xray.config.plan.Plan`, in its groups' node packs; roles of one
    group share them."""
    by_group: dict[str, list] = {}
    for r in plan.roles:
        by_group.setdefault(r.group, []).append(r)
    out: dict[str, Bundles] = {}
    for group, roles in by_group.items():
        first = roles[0]
        bundles = reserve(group, len(first.ranks), first.device, threads, share=len(roles),
                          resources=first.resources, packs=first.packs or None)
        for r in roles:
            out[r.role] = bundles
    return out


def release_all(bundles: Sequence[Bundles]) -> None:
    """Give back every reservation among `bundles` once (roles of one group share theirs)."""
    for b in {id(b): b for b in bundles}.values():
        b.release()
