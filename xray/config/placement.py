"""The `device_groups` section: named sets of devices and the roles placed on each.

Format, as in ms-swift's Ray support:

    device_groups:
      nproc_per_node: 4          # devices per node the cluster must offer
      nnodes: 1                  # nodes (optional, default 1), or min:max as torchrun's --nnodes
      train_group:               # any name
        device: GPU              # GPU or CPU
        ranks: list(range(0, 2)) # device indices: a list, an int count, or list(range(a, b))
        workers: [actor, critic, reference]
        resources: {trainer_node: 1}  # optional: custom Ray resources each device also takes

Ranks are global device indices in [0, nnodes * nproc_per_node); rank r lives on node
r // nproc_per_node, so a group may span nodes. An int count `n` takes the next `n` indices after
the groups written before it. On CPU a "device" is one Workhorse process with a fixed number of
torch threads. `list(range(...))` is parsed with a pattern, never evaluated. `resources` are custom
Ray resources (node labels) each of the group's devices also reserves: a group then lands only on
nodes started with them (`ray start --resources='{"trainer_node": 1}'`).

`nnodes: MIN:MAX` (torchrun's and DLRover's `--nnodes`) lays the ranks out over MAX nodes and lets
the run start on MIN: every group that is not elastic must lie on the first MIN nodes' ranks, and
an elastic group (its trained roles set `elasticity`, `xray/config/batches.py`) must reach its
smallest size there; it starts on what the cluster grants and grows as nodes join.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from xray.config.typed import ConfigError

ROLES = ("actor", "critic", "reference", "teacher", "reward", "rollout", "sampler", "prm", "orm")
"""The RL roles, and the sampling job's (`python -m xray.train sample`): a `sampler` (generation),
and the `prm` and `orm` scoring its candidates, as ms-swift names them."""
_RANGE = re.compile(r"^\s*(?:list\(\s*)?range\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)\s*(?:\))?\s*$")
_LIST = re.compile(r"^\s*\[\s*(-?\d+\s*(?:,\s*-?\d+\s*)*)?,?\s*\]\s*$")


@dataclass(frozen=True)
class DeviceGroup:
    """One named set of devices and the roles placed on it."""

    name: str
    """The group's name: its key in the YAML (any name but `nproc_per_node` and `nnodes`)."""
    device: str
    """`GPU` or `CPU` (on CPU a device is one Workhorse process with `threads_per_worker` torch
    threads)."""
    ranks: tuple[int, ...]
    """Global device indices in [0, nnodes x nproc_per_node): a list, an int count (the next
    indices after the groups written before), or `list(range(a, b))`. They count devices; Ray
    picks the node and the device of each."""
    workers: tuple[str, ...]
    """Roles placed on these devices, which they share (colocation): actor, critic, reference,
    teacher (on-policy distillation), reward, rollout; sampler, prm, orm for the sample job. Each
    role is in exactly one group."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom Ray resources each device of the group also reserves, written as a mapping
    `{name: amount}`: the group lands only on nodes started with them."""

    YAML_DEFAULTS: ClassVar[dict[str, Any]] = {"device": "CPU"}
    """What a group's YAML may leave out besides `resources`, and the value it then takes."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class DeviceGroups:
    """All device groups of a run, checked against each other."""

    nproc_per_node: int = 2
    """Devices per node the cluster must offer."""
    nnodes: int = 1
    """Nodes in the cluster: an int, or `MIN:MAX` as torchrun's `--nnodes` (ranks laid out over MAX
    nodes; the run starts on MIN, its elastic groups growing as nodes join)."""
    min_nnodes: int | None = None
    """The fewest nodes the run starts on (`MIN` of `nnodes: MIN:MAX`); None: `nnodes`."""
    groups: tuple[DeviceGroup, ...] = field(default_factory=tuple)
    """The named groups, in YAML order: every other key of the section is one."""

    @classmethod
    def from_config(cls, data: Any, path: str = "device_groups") -> "DeviceGroups":
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping with nproc_per_node and named groups")
        nproc = _positive_int(data.get("nproc_per_node", 2), f"{path}.nproc_per_node")
        least, nnodes = _node_range(data.get("nnodes", 1), f"{path}.nnodes")
        groups, offset = [], 0
        for name, body in data.items():
            if name in ("nproc_per_node", "nnodes"):
                continue
            group = _parse_group(str(name), body, offset, f"{path}.{name}")
            offset = max(offset, max(group.ranks) + 1) if group.ranks else offset
            groups.append(group)
        result = cls(nproc_per_node=nproc, nnodes=nnodes, groups=tuple(groups),
                     min_nnodes=least if least != nnodes else None)
        result.check(path)
        return result

    def check(self, path: str = "device_groups") -> None:
        """Overlapping ranks, ranks past the cluster, and a role in two groups are errors."""
        total = self.nproc_per_node * self.nnodes
        owner: dict[int, str] = {}
        for g in self.groups:
            beyond = [r for r in g.ranks if r >= total]
            if beyond:
                raise ConfigError(
                    f"{path}.{g.name}.ranks: ranks {beyond} are beyond the {total} devices of "
                    f"nproc_per_node={self.nproc_per_node} x nnodes={self.nnodes}; lower the ranks "
                    f"of group {g.name!r} or raise {path}.nproc_per_node (or nnodes)")
            for r in g.ranks:
                if r in owner:
                    shared = sorted(set(g.ranks) & {k for k, v in owner.items() if v == owner[r]})
                    raise ConfigError(
                        f"{path}: groups {owner[r]!r} and {g.name!r} share ranks {shared}; give each "
                        "group its own ranks, or place both groups' workers in one group to colocate them")
                owner[r] = g.name
        seen: dict[str, str] = {}
        for g in self.groups:
            for w in g.workers:
                if w in seen:
                    raise ConfigError(
                        f"{path}: role {w!r} is placed in two groups, {seen[w]!r} and {g.name!r}; "
                        "list each role in exactly one group's workers")
                seen[w] = g.name

    @property
    def fewest_nodes(self) -> int:
        """The nodes the run may start on: `MIN` of `nnodes: MIN:MAX`, else `nnodes`."""
        return self.nnodes if self.min_nnodes is None else self.min_nnodes

    def on_fewest_nodes(self, group: DeviceGroup) -> int:
        """How many of `group`'s ranks lie on the first `fewest_nodes` nodes."""
        return sum(r < self.fewest_nodes * self.nproc_per_node for r in group.ranks)

    def group_of(self, role: str) -> DeviceGroup | None:
        for g in self.groups:
            if role in g.workers:
                return g
        return None

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def to_plain(self) -> dict:
        out: dict[str, Any] = {"nproc_per_node": self.nproc_per_node,
                               "nnodes": self.nnodes if self.min_nnodes is None else f"{self.min_nnodes}:{self.nnodes}"}
        for g in self.groups:
            out[g.name] = {"device": g.device, "ranks": plain_ranks(g.ranks), "workers": list(g.workers)}
            if g.resources:
                out[g.name]["resources"] = dict(g.resources)
        return out


def plain_ranks(ranks: tuple[int, ...]) -> list[int] | str:
    """Ranks as a config writes them: consecutive ones as `list(range(a, b))` (what `parse_ranks`
    reads back), so that a 512-device group prints in one line; others as the list."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"list(range({ranks[0]}, {ranks[-1] + 1}))"
    return list(ranks)


def _node_range(value: Any, path: str) -> tuple[int, int]:
    """(MIN, MAX) of `nnodes`: an int N (N, N), or `"MIN:MAX"` with 1 <= MIN <= MAX."""
    if isinstance(value, str) and ":" in value:
        parts = value.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"{path}: expected an int or MIN:MAX (as torchrun's --nnodes, e.g. 1:4), got {value!r}")
        least, most = (int(p) for p in parts)
        if not 1 <= least <= most:
            raise ConfigError(f"{path}: {value!r} needs 1 <= MIN <= MAX; write e.g. 1:{max(most, 1)}")
        return least, most
    count = _positive_int(value, path)
    return count, count


def _positive_int(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{path}: expected a positive integer, got {value!r}")
    return value


def parse_ranks(value: Any, offset: int, path: str) -> tuple[int, ...]:
    """A list of ints, an int count (the next `count` indices after `offset`), or
    `list(range(a, b))` / `range(a, b)` / `"[0, 1]"` as a string."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a list of device indices or a count, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{path}: a device count must be at least 1, got {value}")
        return tuple(range(offset, offset + value))
    if isinstance(value, str):
        m = _RANGE.match(value)
        if m:
            a, b = (int(m.group(1)), int(m.group(2))) if m.group(2) else (0, int(m.group(1)))
            value = list(range(a, b))
        elif _LIST.match(value):
            inner = value.strip()[1:-1].strip().rstrip(",")
            value = [int(x) for x in inner.split(",")] if inner else []
        else:
            raise ConfigError(f"{path}: cannot read ranks {value!r}; write a list like [0, 1], "
                              "a count like 2, or list(range(0, 2))")
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                       for r in value):
        raise ConfigError(f"{path}: expected a list of device indices, got {value!r}")
    if not value:
        raise ConfigError(f"{path}: a group needs at least one rank")
    if any(r < 0 for r in value) or len(set(value)) != len(value):
        raise ConfigError(f"{path}: ranks must be distinct non-negative indices, got {list(value)}")
    return tuple(value)


def _parse_group(name: str, body: Any, offset: int, path: str) -> DeviceGroup:
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: a device group is a mapping with device, ranks and workers")
    unknown = set(body) - {"device", "ranks", "workers", "resources"}
    if unknown:
        raise ConfigError(f"unknown key {path}.{sorted(unknown)[0]!r}; a device group has device, ranks, workers "
                          "and optionally resources")
    device = str(body.get("device", DeviceGroup.YAML_DEFAULTS["device"])).upper()
    if device not in ("GPU", "CPU"):
        raise ConfigError(f"{path}.device: must be GPU or CPU, got {body.get('device')!r}")
    if "ranks" not in body:
        raise ConfigError(f"{path}.ranks: missing; give device indices, a count, or list(range(a, b))")
    ranks = parse_ranks(body["ranks"], offset, f"{path}.ranks")
    workers = body.get("workers", [])
    if isinstance(workers, str):
        workers = [workers]
    if not isinstance(workers, list) or not workers:
        raise ConfigError(f"{path}.workers: list the roles placed here, from {', '.join(ROLES)}")
    bad = [w for w in workers if w not in ROLES]
    if bad:
        raise ConfigError(f"{path}.workers: unknown roles {bad}; roles are {', '.join(ROLES)}")
    if len(set(workers)) != len(workers):
        raise ConfigError(f"{path}.workers: a role is listed twice in {workers}")
    return DeviceGroup(name=name, device=device, ranks=ranks, workers=tuple(workers),
                       resources=_parse_resources(body.get("resources") or {}, f"{path}.resources"))


def _parse_resources(value: Any, path: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping of custom Ray resource names to amounts, e.g. {{trainer_node: 1}}")
    for name, amount in value.items():
        if name in ("CPU", "GPU", "memory") or not isinstance(amount, (int, float)) or isinstance(amount, bool) \
                or amount <= 0:
            raise ConfigError(f"{path}.{name}: give custom resource names (not CPU, GPU or memory) with positive "
                              f"amounts, got {amount!r}")
    return tuple(sorted((str(k), float(v)) for k, v in value.items()))
