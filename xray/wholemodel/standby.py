"""Standby Workhorses: warm processes a WholeModel keeps on its nodes to replace lost shards fast.

A Workhorse that starts cold spends most of its start importing its libraries (Ray's worker,
torch, transformers, megatron-core or deepspeed), and a replacement restarts every shard of the
model. A WholeModel asked to (`WholeModel.keep_standby`, the run's `trainer.standby_workhorses`)
keeps that many processes of its Workhorse class on each given node, built as `standby` (no
process group, no CPU pinning, no SIGTERM listener) and warmed (`Workhorse.warm`: the imports).
When it starts shards (`WholeModelActor._spawn`: a restart after a loss, an elastic resize), a
shard whose device sits on a node with a warm standby (its warm-up done) takes it
(`Workhorse.become`) instead of a new process; the pool is refilled in the background afterwards.

Standbys hold no share of the devices: on the CPU the shard's reservation (its placement group
bundle) holds its cores, and the standby works inside it once it became the shard. A GPU shard
needs its GPU assigned by Ray at creation, so GPU models keep no standby (a warning says so).
This file sits in the WholeModel layer; the run decides which models keep standbys and where
(`xray/run/models.py`).
"""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger(__name__)


class Standby:
    """The standby Workhorses of one model, by node."""

    def __init__(self, role: str, remote_cls: Any, env: dict) -> None:
        self.role, self.remote_cls, self.env = role, remote_cls, env
        self.pool: dict[str, list[tuple[Any, Any]]] = {}
        """node id -> [(standby actor, its `warm` answer)], oldest first."""
        self.per_node = 0
        self.nodes: list[str] = []
        self.refills = True
        """Whether a standby taken is replaced (False: the pool serves one resize and is dropped)."""

    def keep(self, per_node: int, nodes: list[str], parallel: Any, init_kwargs: dict, refill: bool = True) -> None:
        """Keep `per_node` standbys on each of `nodes` (those elsewhere are stopped); `refill`:
        replace those taken (`WholeModelActor.restart`)."""
        self.per_node, self.nodes, self.refills = per_node, list(nodes), refill
        for node in [n for n in self.pool if n not in self.nodes]:
            for actor, _ in self.pool.pop(node):
                ray.kill(actor)
        self.refill(parallel, init_kwargs)

    def refill(self, parallel: Any, init_kwargs: dict) -> None:
        """Start standbys where the pool is short of `per_node` (they warm in the background)."""
        for node in self.nodes:
            have = self.pool.setdefault(node, [])
            while len(have) < self.per_node:
                actor = self.remote_cls.options(
                    num_cpus=0, runtime_env={"env_vars": self.env},
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(role=self.role, rank=0, parallel=parallel, standby=True, **init_kwargs)
                have.append((actor, actor.warm.remote()))

    async def prune(self) -> None:
        """Drop the standbys whose warm-up failed (their process or node died): before a take."""
        for node, have in self.pool.items():
            for actor, ref in list(have):
                if not ray.wait([ref], timeout=0)[0]:
                    continue
                try:
                    await ref
                except Exception as exc:  # noqa: BLE001 - any failure: not usable
                    have.remove((actor, ref))
                    log.warning("%s: a standby Workhorse on node %s is lost (%s)", self.role, node[:8],
                                str(exc).splitlines()[0])

    def take(self, node: str) -> Any | None:
        """A warm standby on `node` for a new shard, None when there is none (one still warming is
        left to warm: its node may be going, and a cold start costs no more than waiting for it)."""
        have = self.pool.get(node, [])
        ready = ray.wait([ref for _, ref in have], num_returns=len(have), timeout=0)[0] if have else []
        entry = next((e for e in have if e[1] in ready), None)
        if entry is None:
            return None
        have.remove(entry)
        return entry[0]

    async def pids(self) -> list[int]:
        """The pids of the warm standbys."""
        refs = [ref for have in self.pool.values() for _, ref in have]
        done = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        return [await ref for ref in done]

    def ready(self) -> bool:
        """Whether every node holds its standbys, warm."""
        refs = [ref for node in self.nodes for _, ref in self.pool.get(node, [])]
        if len(refs) < self.per_node * len(self.nodes):
            return False
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return len(done) == len(refs)

    def counts(self) -> dict[str, int]:
        """node id -> standbys held there."""
        return {node: len(have) for node, have in self.pool.items()}

    def clear(self) -> None:
        for have in self.pool.values():
            for actor, _ in have:
                ray.kill(actor)
        self.pool, self.per_node, self.nodes, self.refills = {}, 0, [], True


def slot_node(placement_group: Any, bundle: int) -> str | None:
    """The node id holding `bundle` of `placement_group` (None before it is placed)."""
    from ray.util import placement_group_table

    return placement_group_table(placement_group).get("bundles_to_node_id", {}).get(bundle)
