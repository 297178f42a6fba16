"""`WholeModel`: what the algorithm and notebook users hold. One whole sharded model.

    wm = WholeModel(EchoWorkhorse, role="echo", parallel=ParallelDims(dp=4))
    out = await wm.forward(batch)          # an awaitable ...
    out = wm.forward(batch).get()          # ... or blocking, for scripts and notebooks
    out = wm.call("forward", batch, deadline_s=5).get()
    wm.shutdown()

It starts (or joins) Ray, reserves the devices (a placement group of its own, or bundles of a run's
group handed in by the run's placement), starts the WholeModel Ray actor, which starts the
Workhorses. Dispatch happens here, on the caller's side: each distinct part of the arguments is
put in the object store once and only its reference travels through the WholeModel actor, so a
large batch moves once, as it would in a direct call.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from xray.config.parallel import ParallelDims
from xray.wholemodel import protocol
from xray.wholemodel.cluster import ensure_ray

log = logging.getLogger(__name__)
_SCALARS = (int, float, str, bool, type(None))
# Workhorse environment: the libraries' start-up warnings, repeated by every Workhorse, are noise.
QUIET_ENV = {"PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning",
             "VLLM_LOGGING_LEVEL": "ERROR"}


@dataclass(frozen=True)
class Bundles:
    """Where a WholeModel's Workhorses go: bundles of a placement group, one per rank."""

    placement_group: Any
    indices: tuple[int, ...]
    share: int = 1
    """How many roles share these devices (colocation): each Workhorse takes 1/share of one."""


class Pending:
    """The answer of a WholeModel call: `await` it, or `.get()` it."""

    def __init__(self, ref: Any, limit_s: float | None):
        self.ref, self.limit_s = ref, limit_s

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        from ray.exceptions import RayTaskError

        try:
            return await self.ref
        except RayTaskError as exc:
            raise exc.cause from None

    def get(self, timeout: float | None = None) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        try:
            return ray.get(self.ref, timeout=timeout if timeout is not None else self.limit_s)
        except RayTaskError as exc:
            raise exc.cause from None


class _Method:
    def __init__(self, model: "WholeModel", name: str):
        self.model, self.name = model, name

    def __call__(self, *args, **kwargs) -> Pending:
        return self.model.call(self.name, *args, **kwargs)


def _is_small(args: tuple, kwargs: dict) -> bool:
    return all(isinstance(v, _SCALARS) for v in (*args, *kwargs.values()))


class WholeModel:
    """A whole sharded model: its Workhorses behind one WholeModel Ray actor."""

    def __init__(self, workhorse_cls: type, *, role: str = "model", parallel: ParallelDims = ParallelDims(),
                 device: str = "CPU", bundles: Bundles | None = None, seed: int = 0, threads: int = 1,
                 init_kwargs: dict | None = None, ray_address: str | None = None,
                 start_timeout_s: float = 600.0, env: dict | None = None):
        import ray

        from xray.wholemodel.actor import WholeModelActor
        from xray.wholemodel.placement import reserve

        ensure_ray(ray_address)
        self.role, self.parallel, self.device = role, parallel, device.upper()
        self.methods = protocol.fanout_methods(workhorse_cls)
        self._own_pg = bundles is None
        if bundles is None:
            bundles = reserve(f"{role}", parallel.world_size, self.device, threads)
        if len(bundles.indices) != parallel.world_size:
            raise ValueError(f"{role}: {len(bundles.indices)} devices given for tp*pp*dp = {parallel.world_size}")
        self.bundles = bundles
        if self.device == "GPU":
            resources = {"num_gpus": 1.0 / bundles.share, "num_cpus": 0}
        else:
            resources = {"num_cpus": threads / bundles.share}
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **QUIET_ENV, **(env or {})}
        kwargs = dict(seed=seed, device=self.device.lower(), threads=threads, **(init_kwargs or {}))
        self._actor = ray.remote(WholeModelActor).options(num_cpus=0, max_concurrency=1000).remote(
            role, workhorse_cls, parallel, kwargs, bundles.placement_group, list(bundles.indices),
            resources, env)
        self.layout = Pending(self._actor.start.remote(start_timeout_s), start_timeout_s + 30).get()
        log.info("%s ready: %d Workhorses, tp=%d pp=%d dp=%d", role, len(self.layout),
                 parallel.tp, parallel.pp, parallel.dp)

    @classmethod
    def from_pretrained(cls, model_dir: str, *, backend: str = "hf", role: str = "actor", tp: int = 1,
                        pp: int = 1, dp: int = 1, device: str = "CPU", seed: int = 0, threads: int = 1,
                        ray_address: str | None = None, **engine_kwargs) -> "WholeModel":
        """A standalone WholeModel from a Hugging Face directory: no YAML, for notebooks and scripts."""
        from xray.workhorse.roles import workhorse_class

        return cls(workhorse_class(backend, role), role=role, parallel=ParallelDims(tp, pp, dp),
                   device=device, seed=seed, threads=threads, ray_address=ray_address,
                   init_kwargs=dict(model_dir=str(model_dir), backend=backend, **engine_kwargs))

    def __getattr__(self, name: str) -> _Method:
        methods = self.__dict__.get("methods", {})
        if name in methods:
            return _Method(self, name)
        raise AttributeError(f"{self.__dict__.get('role', 'WholeModel')} has no method {name!r} marked "
                             f"with @fanout; marked methods: {sorted(methods)}")

    def call(self, method: str, *args, deadline_s: float | None = None, **kwargs) -> Pending:
        """Call marked Workhorse method `method` on the whole model; returns a Pending answer."""
        import ray

        meta = self.methods.get(method)
        if meta is None:
            raise AttributeError(f"{self.role} has no method {method!r} marked with @fanout; "
                                 f"marked methods: {sorted(self.methods)}")
        refs = self._dispatch(meta, args, kwargs)
        deadline = meta.deadline_s if deadline_s is None else deadline_s
        return Pending(self._actor.call.remote(method, refs, deadline), deadline + 30)

    def _dispatch(self, meta: protocol.FanOut, args: tuple, kwargs: dict) -> list:
        """One object-store entry per distinct part; shards of one replica share a reference."""
        import ray

        n = len(self.layout)
        if meta.execute == "first" or meta.dispatch == "all":
            packed = (args, kwargs) if _is_small(args, kwargs) else ray.put((args, kwargs))
            return [packed] * (1 if meta.execute == "first" else n)
        if meta.dispatch == "slice":
            parts = [ray.put(p) for p in protocol.slice_parts(self.parallel.dp, args, kwargs)]
            return [parts[i] for i in protocol.part_of_shard(self.layout)]
        per_shard = protocol.dispatch(self.layout, meta.dispatch, args, kwargs)
        seen: dict[int, Any] = {}
        return [seen.setdefault(id(p), ray.put(p)) for p in per_shard]

    def shard_handles(self) -> list:
        """The Workhorse Ray actors in rank order (direct calls: benchmarks, debugging)."""
        return Pending(self._actor.shard_handles.remote(), 60).get()

    def shutdown(self) -> None:
        """Stop the Workhorses and the WholeModel actor, and free the devices it reserved."""
        import ray

        try:
            Pending(self._actor.shutdown.remote(), 30).get()
        except Exception as exc:  # noqa: BLE001 - shutting down: report and go on
            log.warning("%s: shutdown of Workhorses failed: %s", self.role, exc)
        ray.kill(self._actor)
        if self._own_pg:
            ray.util.remove_placement_group(self.bundles.placement_group)

    def __enter__(self) -> "WholeModel":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

