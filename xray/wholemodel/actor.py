"""The WholeModel Ray actor: the control plane of one model. It owns the model's Workhorses.

It creates one Workhorse Ray actor per device bundle of its placement groups, has rank 0 pick the
rendezvous address, joins them into the model's process group, builds the shards, and checks
that the shard infos they report agree. It is placed on the Ray head node, outside the devices'
reservation: it outlives any Workhorse's node and a release of the devices, and `restart` starts
new Workhorses under it. It is not on the data path: callers hold the Workhorse handles it
returns and call them directly (`xray.wholemodel.handle`), so arguments and answers never pass
through this process. It owns one kind of answer, by reference only: the trained shards' flash
snapshots (`hand_snapshot`), which must outlive both the Workhorses and their caller.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from xray import protocol
from xray.backends.base import ShardInfo
from xray.config.parallel import ParallelDims
from xray.wholemodel.errors import CallDeadlineExceeded, WholeModelError, WorkhorseDied
from xray.wholemodel.pending import shard_failure
from xray.wholemodel.standby import Standby, slot_node

log = logging.getLogger(__name__)


def check_layout(role: str, infos: list[ShardInfo], parallel: ParallelDims) -> None:
    """Shards must report one consistent layout with one collector per replica."""
    sizes = {(i.world_size, i.tp_size, i.pp_size, i.dp_size) for i in infos}
    expected = (parallel.world_size, parallel.tp, parallel.pp, parallel.dp)
    if sizes != {expected}:
        raise RuntimeError(f"{role}: shards report layouts {sorted(sizes)}, expected {expected}")
    if [i.rank for i in infos] != list(range(len(infos))):
        raise RuntimeError(f"{role}: shards report ranks {[i.rank for i in infos]}")
    protocol.collectors(infos)


class WholeModelActor:
    """Runs as an async Ray actor; see the module docstring."""

    def __init__(self, role: str, workhorse_cls: type, parallel: ParallelDims, init_kwargs: dict,
                 slots: list[tuple[Any, int]], resources: dict, env: dict):
        self.role, self.cls, self.parallel = role, workhorse_cls, parallel
        self.resources, self.env = resources, env
        self.shards: list = []
        self.standby = Standby(role, ray.remote(self.cls), env)
        self.init_kwargs = init_kwargs
        self.from_standby: list[int] = []
        """The ranks of the last start that took a standby process (`xray/wholemodel/standby.py`)."""
        self.rejoined: list[int] = []
        """The ranks of the last restart that kept their process (`restart`)."""
        self.slots: list[tuple[Any, int]] = []
        self._spawn(parallel, init_kwargs, slots)
        self.layout: list[ShardInfo] = []

    def _spawn(self, parallel: ParallelDims, init_kwargs: dict, slots: list[tuple[Any, int]],
               kept: dict[int, Any] | None = None) -> None:
        """Create one Workhorse per slot, (placement group, bundle index) in rank order, or take a
        standby process on the slot's node, or keep the survivor `kept` holds for the rank (they
        build in `start`)."""
        remote_cls = ray.remote(self.cls)
        self.parallel, self.shards, self.init_kwargs, self.from_standby = parallel, [], init_kwargs, []
        self.slots = list(slots)
        for rank, (placement_group, bundle) in enumerate(slots):
            if kept and rank in kept:
                self.shards.append(kept[rank])
                continue
            spare = self.standby.take(slot_node(placement_group, bundle)) if self.standby.per_node else None
            if spare is not None:
                spare.become.remote(rank=rank, parallel=parallel, **init_kwargs)
                self.shards.append(spare)
                self.from_standby.append(rank)
                continue
            options = dict(self.resources, runtime_env={"env_vars": self.env},
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=placement_group, placement_group_bundle_index=bundle))
            self.shards.append(remote_cls.options(**options).remote(
                role=self.role, rank=rank, parallel=parallel, **init_kwargs))

    async def _survivors(self, slots: list[tuple[Any, int]], wait_s: float = 5.0) -> dict[int, Any]:
        """new rank -> Workhorse for the shards a restart keeps (`Workhorse.rejoin`): each on a slot
        (placement group and bundle: its device) the new layout still holds, whatever rank that slot
        now has, alive, free within `wait_s` (one stuck in a collective with a lost peer is not) and
        able to rejoin (`Workhorse.survives`). An elastic resize keeps the standing slots, so the
        survivors take their new rank, data-parallel size and build arguments in their process."""
        if not getattr(self.cls, "REJOINS", False):
            return {}
        old = {(pg.id, b): rank for rank, (pg, b) in enumerate(self.slots) if rank < len(self.shards)}
        moved = {new: old[(pg.id, b)] for new, (pg, b) in enumerate(slots) if (pg.id, b) in old}
        futures = {r: asyncio.ensure_future(_as_future(self.shards[o].survives.remote())) for r, o in moved.items()}
        if not futures:
            return {}
        done, pending = await asyncio.wait(list(futures.values()), timeout=wait_s)
        for f in pending:
            f.cancel()
        return {r: self.shards[moved[r]] for r, f in futures.items()
                if f in done and f.exception() is None and f.result() is not None}

    def keep_standby(self, per_node: int, nodes: list[str], refill: bool = True) -> dict[str, int]:
        """Keep `per_node` warm standby Workhorses on each of `nodes` (`xray/wholemodel/standby.py`);
        0 stops them; `refill`: replace those a restart takes. Returns node id -> standbys now held there."""
        if per_node and self.resources.get("num_gpus"):
            log.warning("%s: GPU Workhorses keep no standby process (Ray assigns a GPU when a process "
                        "starts); replacements start cold", self.role)
            per_node = 0
        if per_node:
            self.standby.keep(per_node, nodes, self.parallel, self.init_kwargs, refill)
        else:
            self.standby.clear()
        return self.standby.counts()

    def standby_ready(self) -> bool:
        """Whether every standby asked for is started and warm."""
        return self.standby.ready()

    async def standby_pids(self) -> list[int]:
        """The pids of the standby processes that are warm (tests check a replacement took them)."""
        return await self.standby.pids()

    async def restart(self, parallel: ParallelDims, init_kwargs: dict, slots: list[tuple[Any, int]],
                      timeout_s: float = 600.0) -> tuple[list[ShardInfo], list, list[int]]:
        """Start this model anew on the given slots (`Bundles.slots()`), in a fresh process group: a
        replacement without a new control plane, or an elastic resize. A shard whose process lives
        on and whose device the new slots still hold rejoins in its own process, at the rank and in
        the layout it now has (`_survivors`, `Workhorse.rejoin`: no process start, no imports);
        every other one (dead, stuck in a collective, draining, of a class that cannot rejoin) is
        killed and a new one starts. Should a survivor fail to rejoin, the group is not waited for:
        every rank then starts in a new process. All hold the initial weights. Returns the shard
        infos, the Workhorse handles and the ranks that kept their process."""
        kept = await self._survivors(slots) if self.shards else {}
        staying = {s._actor_id for s in kept.values()}
        for shard in self.shards:
            if shard._actor_id not in staying:
                ray.kill(shard)
        await self.standby.prune()
        self._spawn(parallel, init_kwargs, slots, kept)
        self.rejoined = sorted(kept)
        if kept:
            log.info("%s: ranks %s keep their processes and rejoin; %d new", self.role, self.rejoined,
                     len(self.shards) - len(kept))
        try:
            started = await self.start(timeout_s, fail_fast=bool(kept))
        except WholeModelError as exc:
            if not kept:
                raise
            log.warning("%s: a rank failed to rejoin (%s); every rank starts in a new process", self.role, exc)
            for shard in self.shards:
                ray.kill(shard)
            await self.standby.prune()
            self._spawn(parallel, init_kwargs, slots)
            self.rejoined = []
            started = await self.start(timeout_s)
        if self.standby.per_node and self.standby.refills:
            log.info("%s: ranks %s took standby processes; refilling the standbys", self.role, self.from_standby)
            self.standby.refill(parallel, init_kwargs)
        return (*started, list(self.rejoined))

    async def restart_replica(self, dp_rank: int, init_kwargs: dict, slots: list[tuple[Any, int]],
                              timeout_s: float = 600.0) -> tuple[list[ShardInfo], list]:
        """Kill the Workhorses of data-parallel replica `dp_rank` alone and start new ones on its
        `slots`, in a process group of their own (`Workhorse.start_alone`): for a model whose
        replicas never communicate (a rollout engine's), the other replicas go on untouched.
        Returns the new shards' infos and handles, in rank order."""
        ranks = [i.rank for i in self.layout if i.dp_rank == dp_rank]
        if len(ranks) != len(slots):
            raise ValueError(f"{self.role} replica {dp_rank} has {len(ranks)} shards, {len(slots)} slots given")
        remote_cls = ray.remote(self.cls)
        for rank, (placement_group, bundle) in zip(ranks, slots):
            ray.kill(self.shards[rank])
            options = dict(self.resources, runtime_env={"env_vars": self.env},
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=placement_group, placement_group_bundle_index=bundle))
            self.shards[rank] = remote_cls.options(**options).remote(
                role=self.role, rank=rank, parallel=self.parallel, **init_kwargs)
        new = [self.shards[r] for r in ranks]
        ((addr, port),) = await self._gather("address", [new[0].address.remote()], timeout_s)
        infos = await self._gather("start_alone", [s.start_alone.remote(addr, port) for s in new], timeout_s)
        for rank, info in zip(ranks, infos):
            self.layout[rank] = info
        log.info("%s: replica %d restarted (%d Workhorses)", self.role, dp_rank, len(new))
        return infos, new

    def kill_workhorses(self) -> None:
        for s in self.shards:
            ray.kill(s)
        self.shards, self.layout, self.rejoined = [], [], []

    def last_rejoined(self) -> list[int]:
        """The ranks that kept their process in the last restart (tests and the run's log)."""
        return list(self.rejoined)

    async def start(self, timeout_s: float = 600.0, fail_fast: bool = False) -> tuple[list[ShardInfo], list]:
        """Rendezvous, join the process group, build the shards; returns their shard infos and
        the Workhorse handles, in rank order. `fail_fast`: raise at the first rank's failure
        (the others then wait in the rendezvous until its timeout)."""
        t0 = time.perf_counter()
        ((addr, port),) = await self._gather("address", [self.shards[0].address.remote()], timeout_s)
        calls = [s.rejoin.remote(addr, port, rank, self.parallel, self.init_kwargs) if rank in self.rejoined
                 else s.start.remote(addr, port) for rank, s in enumerate(self.shards)]
        self.layout = await self._gather("start", calls, timeout_s, fail_fast)
        check_layout(self.role, self.layout, self.parallel)
        log.info("%s: %d Workhorses ready in %.1f s", self.role, len(self.shards), time.perf_counter() - t0)
        return self.layout, list(self.shards)

    async def _gather(self, method: str, refs: list, deadline_s: float, fail_fast: bool = False) -> list:
        """Await shard calls; raise one error naming failing or unfinished ranks (`fail_fast`: the
        ranks failed by the first failure, the unfinished ones cancelled)."""
        futures = [asyncio.ensure_future(_as_future(r)) for r in refs]
        done, pending = await asyncio.wait(futures, timeout=deadline_s,
                                           return_when=asyncio.FIRST_EXCEPTION if fail_fast else asyncio.ALL_COMPLETED)
        for f in pending:
            f.cancel()
        if pending and not any(f.exception() is not None for f in done):
            ranks = [i for i, f in enumerate(futures) if f in pending]
            raise CallDeadlineExceeded(self.role, method, deadline_s, ranks)
        failures, died = [], False
        results = []
        for rank, f in enumerate(futures):
            if f in pending:  # fail_fast: a rank failed first; this one's answer is not awaited
                continue
            exc = f.exception()
            if exc is None:
                results.append(f.result())
                continue
            results.append(None)
            failure, dead = shard_failure(self.role, rank, exc)
            failures.append(failure)
            died |= dead
        if failures:
            cls = WorkhorseDied if died else WholeModelError
            raise cls(self.role, method, failures, len(self.shards))
        return results

    def shard_handles(self) -> list:
        """The Workhorse Ray actors, in rank order: what callers submit shard tasks to."""
        return list(self.shards)

    async def hand_snapshot(self, directory: str, key: str, after: list, keep: int = 2,
                            deadline_s: float = 600.0, ranks: list[int] | None = None) -> tuple[None, Any]:
        """Have every shard hand over its snapshot of `directory` taken under `key`
        (`TrainWorkhorse.hand_snapshot`: its files as the call's first answer, the shard's own copy
        then freed) with this actor as the answers' owner: they outlive the Workhorses, and the
        caller too (an asynchronous run's trainer actor, whose successor reads them:
        `kept_snapshot`). Each rank's hand starts after `after[rank]` (that rank's copy: the
        caller's `snapshot` call). Called with two returns (`WholeModel.hand_snapshot`): None,
        once every answer is in (not fetched: each hand's second answer says so), failed or not,
        which the caller's next call on the shards waits for; and the outcome: every rank's
        reference to its files, or the failure (returned, not raised: the first answer must not
        fail the calls that wait for it). The newest `keep` are kept here. `ranks`: only those hand
        theirs (None: all); the others keep theirs in their process, their references None, until
        `hand_kept` asks for them."""
        calls = [s.call.options(num_returns=2).remote("hand_snapshot", ((key,), {}), *after[rank:rank + 1])
                 if ranks is None or rank in ranks else (None, asyncio.sleep(0)) for rank, s in enumerate(self.shards)]
        try:
            await self._gather("hand_snapshot", [ok for _, ok in calls], deadline_s)
        except Exception as exc:  # noqa: BLE001 - the caller's, through the second answer
            return None, exc
        refs = [files for files, _ in calls]
        kept = self._kept = getattr(self, "_kept", {})
        kept.pop(directory, None)
        kept[directory] = (self.parallel, refs)
        while len(kept) > keep:
            kept.pop(next(iter(kept)))
        return None, refs

    async def hand_kept(self, key: str) -> dict[int, Any]:
        """Every shard still keeping its snapshot taken under `key` (`hand_snapshot` left it in its
        process) hands it now, this actor owning the answers: the rank each was taken as -> its
        reference (a restore whose handed copies were lost with their node). A shard that keeps
        none, or fails, adds nothing."""
        calls = [s.call.options(num_returns=2).remote("hand_snapshot", ((key,), {"missing_ok": True}))
                 for s in self.shards]
        taken = await asyncio.gather(*[_as_future(rank) for _, rank in calls], return_exceptions=True)
        return {rank: files for (files, _), rank in zip(calls, taken) if isinstance(rank, int)}

    def kept_snapshot(self, directory: str) -> tuple[ParallelDims, list] | None:
        """The layout the snapshot of `directory` was taken in and every rank's reference to it,
        when still kept (`hand_snapshot`; a resize since then leaves it to be resharded)."""
        return getattr(self, "_kept", {}).get(directory)

    def get_layout(self) -> list[ShardInfo]:
        return list(self.layout)

    def pid(self) -> int:
        """This process (tests check that answers do not pass through it)."""
        import os

        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on (rank 0's)."""
        return ray.get_runtime_context().get_node_id()

    async def shutdown(self, grace_s: float = 10.0, keep_standby: bool = False) -> None:
        """Ask every Workhorse to stop (up to `grace_s` seconds), then kill them all (and the
        standby processes, unless `keep_standby`: a restart follows)."""
        refs = [s.shutdown.remote() for s in self.shards]
        try:
            await asyncio.wait_for(asyncio.gather(*[_as_future(r) for r in refs], return_exceptions=True), grace_s)
        except asyncio.TimeoutError:
            pass
        self.kill_workhorses()
        if not keep_standby:
            self.standby.clear()


async def _as_future(ref):
    return await ref
