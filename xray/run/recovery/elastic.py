"""Elastic data parallelism: the training device groups follow the cluster between step boundaries.

A device group whose trained roles set `elasticity` (`xray/config/batches.py`) may hold any of the
sizes its bounds allow. Two events move it:
- **shrink**: one of its Workhorses died with its node (the group's reservation lost a device;
  a killed process alone is replaced in place, as in any group). Recovery
  (`xray.run.recovery.recover`) asks `Elastic.shrink`: the group is placed again on as many
  devices as the cluster now grants (the largest allowed size), keeping the devices that still
  stand, whose Workhorses keep their processes and rejoin at their new rank (`Models.place`:
  no process start and no imports for them). Its models then restore the newest complete
  snapshot in memory (or, where none can be read, the latest checkpoint on disk), resharded to
  the new layout, and the steps since run again: at most the step in flight.
- **grow**: at a step boundary, a group below its largest size sees free devices that fit it (a
  node joined), has kept its size for `elasticity.min_time` minutes, and its models' standby
  processes on the joined node are warm (`trainer.standby_workhorses`; with none, one process per
  model started on the joined node for the grow alone, `Models.warm_joined`: the run goes on at
  its size while they import). The group is placed on the larger size (its Workhorses keep their
  processes; the joined devices take the warm ones) and its models restore the snapshot in memory of the step just finished
  (resharded by the engines; from disk only where it cannot be read): no step is lost.
- **drain**: a Workhorse of the group got SIGTERM (a preemption notice, `xray/workhorse/drain.py`)
  on a node other than the head: Ray is told the node drains, so nothing new is placed there, and
  at the step boundary the group shrinks onto the devices left (as above, from the snapshot in
  memory of the step just finished: nothing runs again).
After any of them, the mini-batch is micro-batch x accumulation x data-parallel size for the new size
(`RLTrainer.batches`); the change is logged, and each step's metrics carry the group's device
count (`elastic/<group>_devices`), the mini-batch and the resizes so far.
"""
from __future__ import annotations

import asyncio
import logging
import time

from xray.config.batches import elastic_ranges
from xray.wholemodel.placement import PlacementError, free_devices

log = logging.getLogger(__name__)


class ElasticError(RuntimeError):
    """The cluster cannot give an elastic group even its smallest size."""


class Elastic:
    """The elastic device groups of a run, and their resizing."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.ranges = {er.group: er for er in elastic_ranges(trainer.cfg, trainer.cfg.device_groups)}
        self.resizes = 0
        self.sized_at = {group: time.monotonic() for group in self.ranges}
        """When each group took its current size (its `min_time` counts from there)."""

    def size(self, group: str) -> int:
        return next(r.num_workhorses for r in self.trainer.models.plan.roles if r.group == group)

    def group_of(self, role: str) -> str | None:
        return next((g for g, er in self.ranges.items() if role in er.roles), None)

    def lost_devices(self, group: str) -> bool:
        """Whether `group`'s reservation lost a device (its node left); a killed process loses none."""
        from xray.wholemodel.placement import standing

        bundles = self.trainer.models.bundles[self.ranges[group].roles[0]]
        return len(standing(bundles)) < len(bundles.placement_groups())

    def _free(self, group: str) -> int:
        first = next(r for r in self.trainer.models.plan.roles if r.group == group)
        return free_devices(first.device, self.trainer.cfg.threads_per_worker, first.resources,
                            tuple(getattr(self.trainer.models, "drained", ())))  # not onto a draining node

    def metrics(self) -> dict[str, float]:
        out = {f"elastic/{g}_devices": float(self.size(g)) for g in self.ranges}
        out.update({"elastic/mini_batch_size": float(self.trainer.batches().mini_batch_size),
                    "elastic/resizes": float(self.resizes)})
        return out

    async def _place(self, group: str, largest: int, why: str) -> int:
        """Place the released `group` on the largest allowed size up to `largest` the cluster grants."""
        models, cfg, before = self.trainer.models, self.trainer.cfg, self.size(group)
        for n in reversed([n for n in self.ranges[group].sizes if n <= largest]):
            try:
                await asyncio.to_thread(models.place, group, n, cfg)
            except PlacementError as exc:
                log.warning("elastic: %s: %d devices not granted (%s); trying fewer", group, n, exc)
                continue
            self.resizes += n != before
            self.sized_at[group] = time.monotonic() if n != before else self.sized_at[group]
            b = self.trainer.batches()
            shards = [getattr(models, r.role) for r in models.plan.roles if r.group == group]
            log.warning("elastic: %s: %d -> %d devices (%s); actor dp %d, mini-batch %d, actor micro-batch %d; "
                        "%d of %d Workhorses kept their processes", group, before, n, why, models.actor.parallel.dp,
                        b.mini_batch_size, b.micro_of("actor"), sum(len(m.rejoined) for m in shards),
                        sum(len(m.layout) for m in shards))
            return n
        raise ElasticError(f"elastic group {group!r} needs at least {self.ranges[group].smallest} devices and the "
                           "cluster grants fewer; add nodes, or lower min_gpus in its roles' elasticity")

    async def shrink(self, group: str, why: str = "a Workhorse or its node was lost") -> int:
        """A Workhorse of `group` died with its node (or its node drains): place the group on what
        the cluster grants now, its devices that still stand kept (`Models.place`)."""
        models = self.trainer.models
        largest = await asyncio.to_thread(models.standing, group) + await asyncio.to_thread(self._free, group)
        return await self._place(group, largest, why)

    async def drain(self, role: str, rank: int) -> str | None:
        """Workhorse `rank` of `role` got SIGTERM (its node drains): when `role` is in an elastic
        group that can lose a device and the Workhorse's node is not the head's, Ray is told the
        node drains (nothing new lands there; `drain_node`) and the group shrinks onto the devices
        left; its group then, else None (the caller replaces the model on the same devices)."""
        from xray.wholemodel.placement import drain_node, head_node
        from xray.workhorse.drain import GRACE_S

        group = self.group_of(role)
        if group is None or self.size(group) <= self.ranges[group].smallest:
            return None
        models = self.trainer.models
        try:  # the drained process still serves, for its grace period
            node = await getattr(models, role).shard_handles()[rank].node_id.remote()
        except Exception as exc:  # noqa: BLE001 - it is gone already: a replacement on its devices
            log.warning("elastic: %s rank %d did not say its node (%s)", role, rank, str(exc).splitlines()[0])
            return None
        if node == await asyncio.to_thread(head_node) or not await asyncio.to_thread(
                drain_node, node, GRACE_S, f"xray: {role} rank {rank} got SIGTERM"):
            return None
        models.drained.add(node)
        await self.shrink(group, f"{role} rank {rank} got SIGTERM: its node {node[:8]} drains")
        return group

    def growth(self) -> dict[str, int]:
        """Groups that free devices would let grow, and the size each would take."""
        out = {}
        for group, er in self.ranges.items():
            size = self.size(group)
            if time.monotonic() - self.sized_at[group] < 60.0 * er.min_time:
                continue  # elasticity.min_time: not yet
            if size < er.largest and (n := er.fit(size + self._free(group))) is not None and n > size:
                models = self.trainer.models
                if not (models.keep_standby(group, check=True) if models.standby else models.warm_joined(group)):
                    log.info("elastic: %s may grow to %d devices once its standby processes on the joined "
                             "node are warm", group, n)
                    continue
                out[group] = n
        return out

    async def grow(self, save, checkpoints, resume) -> bool:
        """At a step boundary: grow every group that free devices fit, from this step's snapshot in
        memory (`checkpoints.restorable`, resharded to the new size), else from a checkpoint of
        this step on disk (`save()` takes it); `resume(directory, state)` restores; False when none grew."""
        targets = await asyncio.to_thread(self.growth)
        if not targets:
            return False
        step = self.trainer.state.step
        await checkpoints.settle()  # this step's snapshot: complete
        held = checkpoints.restorable()
        if held is None or held.step != step:
            if checkpoints.last_step != step:
                await save()
            await checkpoints.finish()
        await checkpoints.watch_nodes()  # the new node's replica holder warms while the Workhorses start
        for group, n in targets.items():  # its Workhorses keep their processes; the joined devices take warm ones
            await self._place(group, n, "devices joined")
            if not self.trainer.models.standby:
                await asyncio.to_thread(self.trainer.models.drop_joined, group)
        if held is not None and held.step == step:
            source = await resume(held.directory, held.trainer_state)
        else:
            source = await resume(checkpoints.run.latest_checkpoint(), None)
        log.warning("elastic: restored step %d into the new size from %s", step, source)
        return True
