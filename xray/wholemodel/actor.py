"""The WholeModel Ray actor: owns one model's Workhorses and runs each call across them.

It creates one Workhorse Ray actor per device bundle of its placement group, has rank 0 pick the
rendezvous address, joins them into the model's process group, builds the shards, and checks
that the shard infos they report agree. A call arrives with its arguments already dispatched
and put in the object store by the client (`xray.wholemodel.handle`), one object per distinct
part; this actor starts the shard calls, waits for them under the call's deadline, turns failures
into one `WholeModelError`, and collects the answer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from xray.backends.base import ShardInfo
from xray.config.parallel import ParallelDims
from xray.wholemodel import protocol
from xray.wholemodel.errors import CallDeadlineExceeded, ShardFailure, WholeModelError, WorkhorseDied

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
                 placement_group: Any, bundle_indices: list[int], resources: dict, env: dict):
        self.role, self.cls, self.parallel = role, workhorse_cls, parallel
        self.methods = protocol.fanout_methods(workhorse_cls)
        remote_cls = ray.remote(workhorse_cls)
        self.shards = []
        for rank, bundle in enumerate(bundle_indices):
            options = dict(resources, runtime_env={"env_vars": env}, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle))
            self.shards.append(remote_cls.options(**options).remote(
                role=role, rank=rank, parallel=parallel, **init_kwargs))
        self.layout: list[ShardInfo] = []

    async def start(self, timeout_s: float = 600.0) -> list[ShardInfo]:
        """Rendezvous, join the process group, build the shards; returns their shard infos."""
        t0 = time.perf_counter()
        ((addr, port),) = await self._gather("address", [self.shards[0].address.remote()], timeout_s)
        await self._gather("init_dist", [s.init_dist.remote(addr, port) for s in self.shards], timeout_s)
        await self._gather("setup", [s.setup.remote() for s in self.shards], timeout_s)
        self.layout = await self._gather("shard_info", [s.shard_info.remote() for s in self.shards], timeout_s)
        check_layout(self.role, self.layout, self.parallel)
        log.info("%s: %d Workhorses ready in %.1f s", self.role, len(self.shards), time.perf_counter() - t0)
        return self.layout

    async def _gather(self, method: str, refs: list, deadline_s: float) -> list:
        """Await shard calls; raise one error naming failing or unfinished ranks."""
        futures = [asyncio.ensure_future(_as_future(r)) for r in refs]
        done, pending = await asyncio.wait(futures, timeout=deadline_s)
        if pending:
            for f in pending:
                f.cancel()
            ranks = [i for i, f in enumerate(futures) if f in pending]
            raise CallDeadlineExceeded(self.role, method, deadline_s, ranks)
        failures, died = [], False
        results = []
        for rank, f in enumerate(futures):
            exc = f.exception()
            if exc is None:
                results.append(f.result())
                continue
            results.append(None)
            if isinstance(exc, RayActorError):
                died = True
                failures.append(ShardFailure(
                    rank, f"Workhorse {self.role} rank {rank} died ({type(exc).__name__}: its process is "
                    "gone); shut this WholeModel down and build it again", str(exc)))
            elif isinstance(exc, RayTaskError):
                cause = exc.cause
                failures.append(ShardFailure(rank, f"{type(cause).__name__}: {cause}",
                                            getattr(exc, "traceback_str", None) or str(exc)))
            else:
                failures.append(ShardFailure(rank, f"{type(exc).__name__}: {exc}", repr(exc)))
        if failures:
            cls = WorkhorseDied if died else WholeModelError
            raise cls(self.role, method, failures, len(self.shards))
        return results

    async def call(self, method: str, shard_refs: list, deadline_s: float | None = None) -> Any:
        """Run `method` with `shard_refs[i]` (an object ref of (args, kwargs)) on rank i."""
        meta = self.methods.get(method)
        if meta is None:
            raise AttributeError(f"{self.cls.__name__} has no method {method!r} marked with @fanout; "
                                 f"marked methods: {sorted(self.methods)}")
        deadline = meta.deadline_s if deadline_s is None else deadline_s
        if meta.execute == "first":
            (result,) = await self._gather(method, [self.shards[0].call.remote(method, shard_refs[0])], deadline)
            return result
        refs = [s.call.remote(method, ref) for s, ref in zip(self.shards, shard_refs)]
        results = await self._gather(method, refs, deadline)
        return protocol.collect(self.layout, meta.collect, results)

    def shard_handles(self) -> list:
        """The Workhorse Ray actors, in rank order (for benchmarks and direct calls)."""
        return list(self.shards)

    def get_layout(self) -> list[ShardInfo]:
        return list(self.layout)

    async def shutdown(self) -> None:
        refs = [s.shutdown.remote() for s in self.shards]
        try:
            await asyncio.wait_for(asyncio.gather(*[_as_future(r) for r in refs], return_exceptions=True), 10)
        except asyncio.TimeoutError:
            pass
        for s in self.shards:
            ray.kill(s)


async def _as_future(ref):
    return await ref
