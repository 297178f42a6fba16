"""Reserving devices on the Ray cluster: one placement group per device group.

A device group of the config becomes one Ray placement group with one bundle per rank (a GPU, or
a CPU slot of `threads` CPUs); every role placed on that group gets the same bundles, and its
Workhorses take `1 / (roles in the group)` of each (colocation). The PACK strategy fills nodes in
order, so a group larger than a node spans nodes.
"""
from __future__ import annotations

import logging
import uuid

from xray.wholemodel.handle import Bundles

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The cluster cannot offer the devices a placement asks for."""


def device_bundle(device: str, threads: int = 1, resources: tuple = ()) -> dict[str, float]:
    """What one device of a group reserves: a GPU or `threads` CPUs, and its custom resources."""
    return {**({"GPU": 1} if device.upper() == "GPU" else {"CPU": threads}), **dict(resources)}


def free_devices(device: str, threads: int = 1, resources: tuple = ()) -> int:
    """How many more such devices the cluster has unreserved now (summed over nodes: an
    estimate that a reservation confirms)."""
    import ray

    have = ray.available_resources()
    return int(min(have.get(k, 0.0) // v for k, v in device_bundle(device, threads, resources).items()))


def reserve(name: str, count: int, device: str, threads: int = 1, timeout_s: float = 120.0,
            share: int = 1, resources: tuple = ()) -> Bundles:
    """A placement group of `count` devices; waits until the cluster grants it."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = device_bundle(device, threads, resources)
    pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK",
                         name=f"xray-{name}-{uuid.uuid4().hex[:8]}")  # unique: runs and models coexist
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        have = ray.cluster_resources()
        raise PlacementError(
            f"device group {name!r} asks for {count} x {bundle}, and the cluster did not grant it in "
            f"{timeout_s:g} s (cluster resources: {have}); free devices, add nodes, or lower the group's ranks")
    return Bundles(pg, tuple(range(count)), share)


def reserve_plan(plan, threads: int = 1) -> dict[str, Bundles]:
    """Bundles for every role of a `xray.config.plan.Plan`; roles of one group share them."""
    by_group: dict[str, list] = {}
    for r in plan.roles:
        by_group.setdefault(r.group, []).append(r)
    out: dict[str, Bundles] = {}
    for group, roles in by_group.items():
        first = roles[0]
        bundles = reserve(group, len(first.ranks), first.device, threads, share=len(roles), resources=first.resources)
        for r in roles:
            out[r.role] = bundles
    return out
