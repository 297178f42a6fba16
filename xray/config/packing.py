"""Node packs: which devices of a device group must sit on one node.

A device group is reserved on Ray (`xray/wholemodel/placement.py`) as one placement group per
pack, each with strategy STRICT_PACK: all of a pack's devices on one node. A pack holds the
devices of one model replica (its tp x pp shards, which exchange activations in every layer)
and, where roles share the group (colocation), the replicas of the other roles that overlap it,
so that every replica of every role lands on one node. Packs are as small as that allows, so Ray
may put them on any nodes with room: ranks count devices, they do not name them (Ray picks the
node of each pack and the GPU of each Workhorse on it, through CUDA_VISIBLE_DEVICES).

When a replica is larger than a node (`tp * pp > nproc_per_node`: pipeline stages across nodes),
packs fall back to the tensor-parallel groups (tp shards of one stage) alone: tensor-parallel
peers always share a node, and a `tp` larger than a node is an error.

Pure functions on `ParallelDims`, so the plan (`--dry-run`) prints the packs the runtime reserves.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from xray.config.parallel import LayoutError, ParallelDims

Packs = tuple[tuple[int, ...], ...]
"""Positions in the group (0 .. devices - 1, a Workhorse's rank in each role), one tuple per pack."""


def _components(count: int, sets: Iterable[Iterable[int]]) -> Packs:
    """The connected components of positions [0, count) joined by `sets`, ordered by first position."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for members in sets:
        members = list(members)
        for m in members[1:]:
            parent[root(m)] = root(members[0])
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    return tuple(sorted((tuple(g) for g in groups.values()), key=lambda g: g[0]))


def _replicas(p: ParallelDims) -> list[list[int]]:
    """The ranks of each data-parallel replica (its tp x pp shards)."""
    return [[p.rank_of(t, s, d) for s in range(p.pp) for t in range(p.tp)] for d in range(p.dp)]


def _tp_groups(p: ParallelDims) -> list[list[int]]:
    """The ranks of each tensor-parallel group (the tp shards of one pipeline stage of one replica)."""
    return [[p.rank_of(t, s, d) for t in range(p.tp)] for d in range(p.dp) for s in range(p.pp)]


def node_packs(count: int, layouts: Sequence[ParallelDims], per_node: int | None = None) -> Packs:
    """The packs of a group of `count` devices shared by roles laid out as `layouts` (each of
    world size `count`): every replica of every layout inside one pack. `per_node`: the devices a
    node offers (`nproc_per_node`); a pack larger than that falls back to tensor-parallel groups,
    and one still larger is a LayoutError that says the fix. Without layouts, one pack per device."""
    for p in layouts:
        if p.world_size != count:
            raise LayoutError(f"a layout of tp*pp*dp = {p.world_size} cannot be packed on {count} devices")
    packs = _components(count, (r for p in layouts for r in _replicas(p)))
    if per_node is None or max(len(k) for k in packs) <= per_node:
        return packs
    packs = _components(count, (g for p in layouts for g in _tp_groups(p)))
    if max(len(k) for k in packs) > per_node:
        tps = sorted({p.tp for p in layouts})
        raise LayoutError(f"tensor-parallel groups of {max(len(k) for k in packs)} devices (tp={tps}, across "
                          f"colocated roles) do not fit a node of {per_node} devices; tensor-parallel peers must "
                          f"share a node: lower tp to at most {per_node}, or raise nproc_per_node if the nodes "
                          "have more devices")
    return packs


def whole_replicas(packs: Packs, layouts: Sequence[ParallelDims]) -> bool:
    """True when every replica of every layout lies inside one pack (False after the fallback to
    tensor-parallel groups: pipeline stages then may sit on different nodes)."""
    pack_of = {i: n for n, k in enumerate(packs) for i in k}
    return all(len({pack_of[i] for i in r}) == 1 for p in layouts for r in _replicas(p))


def describe_packs(packs: Packs) -> str:
    """`4 packs of 2`, `1 pack of 8`, `2 packs of 4 and 1 pack of 2`: the packs' sizes, in words."""
    sizes: dict[int, int] = {}
    for k in packs:
        sizes[len(k)] = sizes.get(len(k), 0) + 1
    return " and ".join(f"{n} pack{'s' if n > 1 else ''} of {size}" for size, n in sorted(sizes.items(), reverse=True))


def spans(values) -> str:
    """Integers as ranges, in words: `0-511`, `0-3, 8-11`, `5`."""
    values = sorted(set(values))
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
