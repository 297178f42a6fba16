"""`WholeModel`: what the algorithm and notebook users hold. One whole sharded model.

    wm = WholeModel(EchoWorkhorse, role="echo", parallel=ParallelDims(dp=4))
    out = await wm.forward(batch)          # an awaitable ...
    out = wm.forward(batch).get()          # ... or blocking, for scripts and notebooks
    out = wm.call("forward", batch, deadline_s=5).get()
    logp = actor.forward(rollout.generate(prompts, sampling))   # by reference: no fetch here
    wm.shutdown()

It starts (or joins) Ray, reserves the devices (placement groups of its own, one per replica kept on
one node, or bundles of a run's group handed in by the run's placement), and starts the WholeModel Ray actor (the control plane),
which starts the Workhorses and hands back their handles. A call is dispatched here, on the
caller's side, and its shard tasks go straight to the Workhorses: a part of the arguments that
several shards share is put in the object store once (only the columns the method reads), a
small or unshared one travels inside the shard's call (`INLINE_BYTES`), and the answer
comes back as a `Pending` of object refs that the caller collects, or passes on by reference.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from xray import protocol
from xray.config.parallel import ParallelDims
from xray.wholemodel.cluster import ensure_ray
from xray.wholemodel.pending import Pending
from xray.wholemodel.placement import Bundles
from xray.workhorse.quiet import workhorse_env

log = logging.getLogger(__name__)
_SCALARS = (int, float, str, bool, type(None))
INLINE_BYTES = 64 << 10
"""A part of a call's arguments that several shards share goes into the object store once when it
is larger than this (by `payload_bytes`); a smaller one, and any part that one shard alone takes,
travels inside the shard's call (Ray itself stores an argument over 100 KiB). On the 2-core CI
machine a `ray.put` and the fetch behind it cost about 2 ms a call, more than serializing a probe
or a step's prompts once per shard."""


class _Method:
    """A marked Workhorse method bound to a WholeModel: calling it calls the whole model."""

    def __init__(self, model: "WholeModel", name: str, fn: Any):
        import inspect

        self.model, self.name = model, name
        self.__name__ = name
        self.__doc__ = (f"{fn.__doc__ or ''}\n\nCalled on the whole {model.role} model; returns a Pending "
                        "(await it, or .get() it). Also takes deadline_s= and after=.").strip()
        signature = inspect.signature(fn)
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:],
                                               return_annotation=Pending)

    def __call__(self, *args, **kwargs) -> Pending:
        return self.model.call(self.name, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.model.role}.{self.name}{self.__signature__}>"


def payload_bytes(value: Any, limit: int = INLINE_BYTES) -> int:
    """About how many bytes `value` takes serialized, counted until the count passes `limit`
    (then it returns early). Tensors, arrays, Batches, lists, tuples, dicts, scalars, actor
    handles and by-reference parts are sized; anything else counts as over `limit`."""
    import numpy as np
    from ray.actor import ActorHandle

    from xray.data.batch import Batch
    import torch

    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += 16 + len(v)
        elif isinstance(v, _SCALARS):
            total += 16
        elif isinstance(v, torch.Tensor):
            total += 256 + v.numel() * v.element_size()
        elif isinstance(v, np.ndarray):
            total += 256 + v.nbytes
        elif isinstance(v, Batch):
            stack += [v.tensors, v.lists, v.meta]
        elif isinstance(v, (list, tuple)):
            total += 8 + 8 * len(v)
            if total <= limit:
                stack += v
        elif isinstance(v, dict):
            total += 8 * len(v)
            if total <= limit:
                stack += [*v.keys(), *v.values()]
        elif isinstance(v, (ActorHandle, protocol.PartsSlice)):
            total += 1024
        else:
            total += limit + 1
    return total


def _shared_or_inline(part: tuple[tuple, dict], users: int) -> Any:
    """One part of a call's (args, kwargs): an object-store entry when `users` shards share it and
    it is large, else the part itself, inside each call (`INLINE_BYTES`)."""
    import ray

    return ray.put(part) if users > 1 and payload_bytes(part) > INLINE_BYTES else part


class WholeModel:
    """A whole sharded model: its Workhorses behind one WholeModel Ray actor."""

    def __init__(self, workhorse_cls: type, *, role: str = "model", parallel: ParallelDims = ParallelDims(),
                 device: str = "CPU", bundles: Bundles | None = None, seed: int = 0, threads: int = 1,
                 init_kwargs: dict | None = None, ray_address: str | None = None,
                 start_timeout_s: float = 600.0, env: dict | None = None):
        import ray

        from xray.config.packing import node_packs
        from xray.wholemodel.actor import WholeModelActor
        from xray.wholemodel.placement import reserve

        ensure_ray(ray_address)
        self.role, self.parallel, self.device = role, parallel, device.upper()
        self.methods = protocol.fanout_methods(workhorse_cls)
        self._cls, self._seed, self._threads = workhorse_cls, seed, threads
        self.init_kwargs = dict(init_kwargs or {})
        self.pushed_version = 0
        """The last weight version `xray.sync.sync_to` pushed from this model (0: none yet)."""
        self._own_pg = bundles is None
        if bundles is None:
            bundles = reserve(role, parallel.world_size, self.device, threads,
                              packs=node_packs(parallel.world_size, [parallel]))
        if len(bundles.indices) != parallel.world_size:
            raise ValueError(f"{role}: {len(bundles.indices)} devices given for tp*pp*dp = {parallel.world_size}")
        self.bundles = bundles
        if self.device == "GPU":
            resources = {"num_gpus": 1.0 / bundles.share, "num_cpus": 0}
        else:
            resources = {"num_cpus": threads / bundles.share}
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **workhorse_env(self.device),
               **(env or {})}  # quiet start-up: xray.workhorse.quiet
        kwargs = dict(seed=seed, device=self.device.lower(), threads=threads, **(init_kwargs or {}))
        self._actor = ray.remote(WholeModelActor).options(
            num_cpus=0, max_concurrency=1000, **control_plane_placement()).remote(
            role, workhorse_cls, parallel, kwargs, bundles.slots(), resources, env)
        self.rejoined: list[int] = []
        """The ranks that kept their process in the last `restart`."""
        try:
            self.layout, self.shards = _unwrapped(self._actor.start.remote(start_timeout_s), start_timeout_s + 30)
        except BaseException:
            self._release()  # nothing of a failed start outlives it: Workhorses, actor, reservation
            raise
        log.debug("%s ready: %d Workhorses, tp=%d pp=%d dp=%d", role, len(self.layout),
                 parallel.tp, parallel.pp, parallel.dp)

    @classmethod
    def from_pretrained(cls, model_dir: str, *, backend: str = "hf", role: str | None = None, tp: int = 1,
                        pp: int = 1, dp: int = 1, ep: int = 1, device: str = "CPU", seed: int = 0, threads: int = 1,
                        ray_address: str | None = None, **options) -> "WholeModel":
        """A standalone WholeModel from a local Hugging Face directory: no YAML, for notebooks and scripts.

        Backends and the roles they serve (the first is the default):
          - `hf`: actor, reference. Plain transformers, data parallel (dp).
          - `megatron`: actor, critic, reference. Megatron-core, tensor / pipeline / data parallel,
            and expert parallel (`ep`, mixture-of-experts models: the experts split over ep of the dp).
          - `deepspeed`: actor, critic, reference. DeepSpeed ZeRO (`zero_stage`, default 3), dp only.
          - `vllm`, `dsinfer`: rollout. Generation engines; tp inside a replica, dp replicas.
          - `hf-reward`: reward. A sequence-classification model that scores sequences.
        Options (keyword arguments), by backend:
          - `optim` (training backends): a dict or `OptimConfig`: lr, weight_decay, betas, eps,
            grad_clip, warmup_steps. `attention` (megatron): "sdpa" or "megatron".
            `forward_micro_batch_size` (megatron, deepspeed): rows per forward micro-batch;
            `max_tokens_per_micro_batch` (megatron with pp=1, deepspeed): a token budget per
            forward and train micro-batch instead (`xray/data/budget.py`); `packing` (the same):
            each micro-batch's rows as one sequence without padding (`xray/data/packing.py`).
          - `dtype` (vllm, dsinfer): "float32" or "bfloat16"; `max_model_len` (default: the model's
            max_position_embeddings); `kv_cache_gib` (vllm on CPU); `generate_batch` (dsinfer);
            `stop_strings` (both): load the tokenizer so that `generate` may give `stop` strings.
        Everything is checked here before any process starts (directory, role, layout against the
        model's heads and layers, options, dtype); a WholeModel whose start fails frees all it took.
        `device` is "CPU" or "GPU"; `threads` torch threads per CPU Workhorse; `ray_address` joins a
        cluster (default: $RAY_ADDRESS, or a local one)."""
        from xray.wholemodel.pretrained import prepare
        from xray.workhorse.roles import workhorse_class

        parallel = ParallelDims(tp, pp, dp, ep)
        role, init_kwargs = prepare(model_dir, backend, role, parallel, options)
        return cls(workhorse_class(backend, role), role=role, parallel=parallel, device=device, seed=seed,
                   threads=threads, ray_address=ray_address, init_kwargs=init_kwargs)

    def __getattr__(self, name: str) -> _Method:
        methods = self.__dict__.get("methods", {})
        if name in methods:
            return _Method(self, name, getattr(self.__dict__["_cls"], name))
        raise AttributeError(f"{self.__dict__.get('role', 'WholeModel')} has no method {name!r} marked "
                             f"with @fanout; marked methods: {sorted(methods)}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.methods))

    def __repr__(self) -> str:
        p = self.parallel
        return (f"<WholeModel {self.role}: {self.__dict__['_cls'].__name__} x{len(self.layout)} "
                f"(tp={p.tp} pp={p.pp} dp={p.dp}) methods {sorted(self.methods)}>")

    def call(self, method: str, *args, deadline_s: float | None = None, after: tuple = (), **kwargs) -> Pending:
        """Call marked Workhorse method `method` on the whole model; returns a Pending answer.

        Arguments may be Pendings of other calls (passed by reference). `after`: Pendings (or
        Ray object references) whose tasks must finish before this call's start (ordering without
        waiting here)."""
        meta = self.methods.get(method)
        if meta is None:
            raise AttributeError(f"{self.role} has no method {method!r} marked with @fanout; "
                                 f"marked methods: {sorted(self.methods)}")
        args = tuple(_as_batch(a) for a in args)
        kwargs = {k: _as_batch(v) for k, v in kwargs.items()}
        packed = self._dispatch(meta, args, kwargs)
        ranks = [0] if meta.execute == "first" else list(range(len(self.layout)))
        waits = [ref for p in after for ref in (p.refs if isinstance(p, Pending) else [p])]
        waits += self.__dict__.pop("_barrier", [])  # a snapshot's hand, issued by the actor, goes first
        refs = [self.shards[r].call.remote(method, packed[i], *waits) for i, r in enumerate(ranks)]
        deadline = meta.deadline_s if deadline_s is None else deadline_s
        return Pending(self.role, method, meta, self.layout, refs, ranks, deadline)

    def _dispatch(self, meta: protocol.FanOut, args: tuple, kwargs: dict) -> list:
        """(args, kwargs) per shard, in rank order: a distinct part that several shards share (the
        shards of one replica) is one object-store entry when large, any other travels inside the
        calls (`_shared_or_inline`). Batches carry only the columns the method reads."""
        columns = meta.columns(args, kwargs)
        args = tuple(protocol.select_columns(a, columns) for a in args)
        kwargs = {k: protocol.select_columns(v, columns) for k, v in kwargs.items()}
        n = 1 if meta.execute == "first" else len(self.layout)
        if meta.dispatch == "all" or meta.execute == "first":
            return [_shared_or_inline(_by_reference(args, kwargs, 1, columns)[0], n)] * n
        if meta.dispatch == "slice":
            owners = protocol.part_of_shard(self.layout)
            parts = [_shared_or_inline(p, owners.count(d)) for d, p in
                     enumerate(_by_reference(args, kwargs, self.parallel.dp, columns, split=True))]
            return [parts[d] for d in owners]
        per_shard = protocol.dispatch(self.layout, meta.dispatch, args, kwargs)
        users, distinct = Counter(id(p) for p in per_shard), {id(p): p for p in per_shard}
        packed = {key: _shared_or_inline(p, users[key]) for key, p in distinct.items()}
        return [packed[id(p)] for p in per_shard]

    def replica(self, dp_rank: int) -> "WholeModel":
        """A view of one data-parallel replica (its TP/PP shards) as a model of dp=1: calls on it
        reach only that replica (an experience maker drives one rollout replica this way). The
        view shares the model's Workhorses; shut the model down, not the view."""
        import copy
        import dataclasses

        shards = [s for s in self.layout if s.dp_rank == dp_rank]
        if self.parallel.ep > 1:
            raise ValueError(f"{self.role} splits its experts over {self.parallel.ep} replicas (ep), which run "
                             "every call together: call the whole model, not one replica")
        if not shards:
            raise ValueError(f"{self.role} has replicas 0..{self.parallel.dp - 1}, not {dp_rank}")
        view = copy.copy(self)
        view.parallel = ParallelDims(self.parallel.tp, self.parallel.pp, 1)
        view.layout = [dataclasses.replace(s, rank=i, world_size=len(shards), dp_rank=0, dp_size=1)
                       for i, s in enumerate(shards)]
        view.shards = [self.shards[s.rank] for s in shards]
        view._view_of = self
        return view

    def dead_ranks(self, wait_s: float = 1.0) -> list[int]:
        """The ranks whose Workhorse process is gone (a ping answered by Ray with the actor's death;
        a busy Workhorse answers later and counts as alive: `xray.wholemodel.liveness`)."""
        from xray.wholemodel.liveness import dead_shards

        return dead_shards({self.role: self}, wait_s).get(self.role, [])

    def shard_handles(self) -> list:
        """The Workhorse Ray actors in rank order (direct calls: weight sync, benchmarks)."""
        return list(self.shards)

    def restart(self, parallel: ParallelDims | None = None, bundles: Bundles | None = None,
                init_kwargs: dict | None = None, timeout_s: float = 600.0) -> None:
        """Start the model anew in a fresh process group, on the same devices or on `bundles` with
        layout `parallel` (elastic resizing; `init_kwargs` replaces what the shards are built
        with): a dead Workhorse is replaced by a new process; a live one whose device `bundles`
        still hold rejoins in its own process, at the rank that device now has, when its class can
        (`Workhorse.rejoin`; training Workhorses), else it is replaced too. The WholeModel actor stays; every shard holds the
        initial weights. Raises `ray.exceptions.RayActorError`
        when the WholeModel actor itself is gone (its node left): build a new WholeModel then."""
        parallel, bundles = parallel or self.parallel, bundles or self.bundles
        if len(bundles.indices) != parallel.world_size:
            raise ValueError(f"{self.role}: {len(bundles.indices)} devices given for tp*pp*dp = {parallel.world_size}")
        if init_kwargs is not None:
            self.init_kwargs = dict(init_kwargs)
        kwargs = dict(seed=self._seed, device=self.device.lower(), threads=self._threads, **self.init_kwargs)
        ref = self._actor.restart.remote(parallel, kwargs, bundles.slots(), timeout_s)
        self.layout, self.shards, self.rejoined = _unwrapped(ref, timeout_s + 30)
        self.parallel, self.bundles = parallel, bundles
        log.info("%s restarted: %d Workhorses (ranks %s in their own processes), tp=%d pp=%d dp=%d", self.role,
                 len(self.layout), self.rejoined, parallel.tp, parallel.pp, parallel.dp)

    def restart_replica(self, dp_rank: int, timeout_s: float = 600.0) -> None:
        """Replace the Workhorses of data-parallel replica `dp_rank` alone (one died), on the same
        devices, while the other replicas go on: for a model whose replicas never talk to each
        other (a rollout engine; its Workhorses implement `start_alone`). The new shards hold the
        initial weights. Views taken before (`replica`) still hold the old handles: take new ones."""
        if self.__dict__.get("_view_of") is not None:
            raise RuntimeError(f"this is a view of one {self.role} replica; restart it on the model it came from")
        ranks = [s.rank for s in self.layout if s.dp_rank == dp_rank]
        if not ranks:
            raise ValueError(f"{self.role} has replicas 0..{self.parallel.dp - 1}, not {dp_rank}")
        slots = [self.bundles.slots()[r] for r in ranks]
        kwargs = dict(seed=self._seed, device=self.device.lower(), threads=self._threads, **self.init_kwargs)
        infos, shards = _unwrapped(self._actor.restart_replica.remote(dp_rank, kwargs, slots, timeout_s),
                                   timeout_s + 30)
        for rank, info, shard in zip(ranks, infos, shards):
            self.layout[rank], self.shards[rank] = info, shard
        log.info("%s: replica %d restarted (ranks %s)", self.role, dp_rank, ranks)

    def stop_workhorses(self, grace_s: float = 0.0) -> None:
        """Stop the Workhorses and keep the WholeModel actor and its standby processes (`restart`
        starts new ones)."""
        _unwrapped(self._actor.shutdown.remote(grace_s, True), grace_s + 20)

    def keep_standby(self, per_node: int, nodes: list[str], refill: bool = True) -> dict[str, int]:
        """Keep `per_node` warm standby processes of this model's Workhorse class on each of `nodes`
        (Ray node ids; 0 stops them): a restart (`restart`, `Models.replace`, an elastic resize)
        then builds its shards on those nodes in them instead of cold processes, and starts new
        standbys in their place unless `refill` is False (`xray/wholemodel/standby.py`). Returns
        node id -> standbys held there."""
        return _unwrapped(self._actor.keep_standby.remote(per_node, list(nodes), refill), 60)

    def hand_snapshot(self, directory: str, key: str, after: Pending, keep: int = 2, ranks: list[int] | None = None):
        """Have every shard hand over its snapshot of `directory` taken under `key` by the call
        `after` (`TrainWorkhorse.snapshot`), right behind it, the WholeModel actor owning the
        answers (they outlive the caller and the Workhorses; the actor keeps the newest `keep` for
        `kept_snapshot`). This handle's next call waits for the hand (as it would behind a hand of
        its own). An awaitable resolved once the answers are in; `handed_snapshot(key)` then gives
        their references. `ranks`: only those hand theirs, the others keep it (`hand_kept`)."""
        barrier, outcome = self._actor.hand_snapshot.options(num_returns=2).remote(
            directory, key, list(after.refs), keep, ranks=ranks)
        self.__dict__["_barrier"] = [barrier]
        handed = self.__dict__.setdefault("_handed", {})
        while len(handed) >= 8:  # outcomes no one asked for
            handed.pop(next(iter(handed)))
        handed[key] = outcome
        return barrier

    def handed_snapshot(self, key: str):
        """An awaitable of every rank's reference to the snapshot handed under `key` by this
        handle's `hand_snapshot`, or of its failure (raised)."""
        outcome = self.__dict__.get("_handed", {}).pop(key, None)
        if outcome is None:
            raise RuntimeError(f"{self.role}: no snapshot was handed under {key!r}; call hand_snapshot first")
        return _handed_refs(outcome)

    def hand_kept(self, key: str):
        """An awaitable of {rank it was taken as: reference} for the shards that kept their snapshot
        taken under `key` in their process (`hand_snapshot(ranks=)`), each handed now."""
        return self._actor.hand_kept.remote(key)

    def kept_snapshot(self, directory: str):
        """An awaitable of (the layout it was taken in, every rank's reference) for the snapshot of
        `directory`, if the WholeModel actor still keeps it (else None): a caller taking over from
        one that died reads them."""
        return self._actor.kept_snapshot.remote(directory)

    def standby_ready(self) -> bool:
        """Whether every standby process asked for by `keep_standby` is started and warm."""
        return _unwrapped(self._actor.standby_ready.remote(), 60)

    def shutdown(self, release: bool = True, grace_s: float = 10.0) -> None:
        """Stop the Workhorses (each given `grace_s` seconds to finish its work, then killed) and
        the WholeModel actor, and free the devices it reserved (kept with `release=False`, for a
        replacement on the same devices)."""
        self._release(release, grace_s)

    def _release(self, release: bool = True, grace_s: float = 10.0) -> None:
        """Stop the Workhorses, kill the WholeModel actor, free its own reservation."""
        import ray

        if self.__dict__.get("_view_of") is not None:
            raise RuntimeError(f"this is a view of one {self.role} replica; shut down the model it came from")

        try:
            _unwrapped(self._actor.shutdown.remote(grace_s), grace_s + 20)
        except Exception as exc:  # noqa: BLE001 - shutting down: report and go on
            log.warning("%s: shutdown of Workhorses failed: %s", self.role, exc)
        ray.kill(self._actor)
        if self._own_pg and release:
            self.bundles.release()

    def __enter__(self) -> "WholeModel":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()



def control_plane_placement() -> dict:
    """Where a WholeModel actor goes: on the head node (a sliver of the resource Ray gives only
    the head), outside any device reservation, so it outlives the loss of a Workhorse's node
    and a release of the devices (elastic resizing, `WholeModel.restart`); the head's loss ends
    the Ray cluster anyway. Without that resource, on the caller's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _HEAD_RESOURCE in ray.cluster_resources():
        return {"resources": {_HEAD_RESOURCE: 0.001}}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}


_HEAD_RESOURCE = "node:__internal_head__"


def blocking(coroutine) -> Any:
    """Run a coroutine to its end from blocking code, also inside a notebook's running event loop
    (there on a helper thread with a loop of its own)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _unwrapped(ref: Any, timeout_s: float) -> Any:
    """ray.get that raises the Workhorse-side error itself, not Ray's wrapper."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as exc:
        raise exc.cause from None


def _as_batch(value: Any) -> Any:
    """A dict of tensors with one leading size becomes a Batch (so notebooks may pass plain dicts)."""
    import torch

    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        from xray.data.batch import Batch

        return Batch(dict(value))
    return value


def _by_reference(args: tuple, kwargs: dict, replicas: int, columns, split: bool = False) -> list[tuple[tuple, dict]]:
    """(args, kwargs) per replica: each Pending replaced by the PartsSlice of its rows, and (with
    `split`, the `slice` dispatch) every batch-like value split into equal consecutive parts."""
    def pieces(value: Any, where: str) -> list:
        if isinstance(value, Pending):
            parts = value.parts
            return [protocol.PartsSlice(tuple(parts[a:b]), skip, take, den, columns)
                    for a, b, skip, take, den in protocol.remote_slices(len(parts), replicas)]
        if split and protocol.is_sliceable(value):
            return protocol.split_one(value, replicas, where)
        return [value] * replicas

    split_args = [pieces(a, f"argument {i}") for i, a in enumerate(args)]
    split_kwargs = {k: pieces(v, f"argument {k!r}") for k, v in kwargs.items()}
    return [(tuple(s[d] for s in split_args), {k: s[d] for k, s in split_kwargs.items()})
            for d in range(replicas)]


async def _handed_refs(outcome) -> list:
    """The references a hand's outcome holds, or its failure raised."""
    refs = await outcome
    if isinstance(refs, BaseException):
        raise refs
    return refs
