"""TrainWorkhorse: the actor, critic and reference Workhorse on a training backend engine.

One class serves every training backend (`megatron`, `deepspeed`) and the three trainable roles:
`setup()` asks the backend registry for the engine factory and builds this rank's shard; the
marked methods below are the WholeModel-facing contract (forward, train step, export, save/load).
The engine decides who collects (tp_rank 0 on the last pipeline stage), and reports it.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from xray.backends import load_backend
from xray.backends.base import LossFn, ShardInfo, TrainEngine
from xray.config.optim import OptimConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.protocol import fanout
from xray.transport import faults, ipc, pg, shm
from xray.transport.wire import manifest_of, pack_bucket
from xray.workhorse import heap
from xray.workhorse.base import Workhorse, train_step_columns

TRANSPORTS = ("auto", "objstore", "shm", "ipc", "pg")
KEPT_SNAPSHOTS = 2
"""Flash snapshots a training Workhorse holds until they are handed over, the newest, by directory."""


def choose_transport(transport: str, gpu: bool, same_node: bool, same_gpu: list[bool], shm_room) -> str:
    """The weight-sync transport (`sync.transport`) from an exporting shard on a GPU or not to
    targets all on its node or not, each sharing its GPU or not (`shm_room()`: /dev/shm can hold
    the slots). An explicit choice the placement cannot take stops with the fix."""
    if transport == "shm" and (not same_node or gpu):
        raise ValueError("sync.transport=shm needs every rollout shard on the actor's node and the CPU; "
                         "use auto (it picks CUDA IPC or the process group on GPUs, the group across nodes)")
    if transport == "ipc" and not (gpu and all(same_gpu)):
        raise ValueError("sync.transport=ipc needs every rollout shard on the actor's own GPU; use auto")
    if transport == "pg" and any(same_gpu):
        raise ValueError("sync.transport=pg cannot join processes that share a GPU into one NCCL group "
                         "(NCCL: 'Duplicate GPU detected'); use auto (CUDA IPC there) or ipc")
    if transport != "auto":
        return transport
    if gpu:
        return "ipc" if all(same_gpu) else "objstore" if any(same_gpu) else "pg"
    if not same_node:
        return "pg"
    return "shm" if shm_room() else "objstore"


def _fetch(ref, copy: bool = True) -> dict:
    """A snapshot's files behind `ref` (`hand_snapshot`'s answer, or the replica pinned on another
    node when its node was lost); `copy=False`: over the object store's memory, read-only (to write)."""
    import ray

    from xray.backends.snapshot import from_wire

    return from_wire(ray.get(ref, timeout=60), copy)


def _replica_metrics(layout: list[ShardInfo], results: list) -> dict[str, float]:
    """The engines already average metrics over replicas; report the first collector's."""
    first = min((s for s in layout if s.collects), key=lambda s: s.dp_rank)
    return results[first.rank]


def _exported(layout: list[ShardInfo], results: list) -> Any:
    """The one non-None answer (the exporting shard's)."""
    found = [r for r in results if r is not None]
    return found[0] if found else None


def forward_columns(args: tuple, kwargs: dict) -> tuple[str, ...]:
    """What `forward` ships: the model inputs, and the routing to replay when asked."""
    return (*C.MODEL_INPUTS, C.ROUTED_EXPERTS) if kwargs.get("routing") else C.MODEL_INPUTS


class TrainWorkhorse(Workhorse):
    """A shard of an actor, critic or reference model on `megatron` or `deepspeed`."""

    engine: TrainEngine
    REJOINS = True
    SELF_TIMED = Workhorse.SELF_TIMED | {"push_weights"}  # busy while exporting, not while waiting

    def __init__(self, role: str, rank: int, parallel, seed: int = 0, **kwargs: Any):
        super().__init__(role, rank, parallel, seed=seed, **kwargs)
        self._groups: dict[tuple, Any] = {}  # sync groups with rollout shards (`xray/transport/pg.py`)
        self._places: dict[tuple, tuple] = {}  # a set of rollout shards: all on this node? which on this GPU?
        self._rings: dict[tuple, shm.SendRing] = {}  # shared-memory slots per set of rollout shards
        self._ipc_rings: dict[tuple, ipc.IpcRing] = {}  # GPU buffers per set of rollout shards on this GPU
        self._adapter_targets: dict[tuple, bool] = {}  # whether a set of rollout shards serves adapters

    def warm(self) -> int:
        """A standby process imports its training backend and the libraries `setup` builds with."""
        module = load_backend(self.config["backend"])
        getattr(module, "preload", lambda: None)()
        return super().warm()

    def setup(self) -> None:
        cfg = dict(self.config)
        backend = cfg.pop("backend")
        model_dir = cfg.pop("model_dir")
        optim = cfg.pop("optim", None) or OptimConfig()
        engine_role = cfg.pop("engine_role", self.role)
        factory = load_backend(backend).build_engine
        heap.freeze_imports()
        self.engine = factory(model_dir, self.parallel, engine_role, optim=optim, seed=self.base_seed,
                              device="cuda" if self.device == "gpu" else "cpu", **cfg)
        self.log.info("%s shard built on %s", backend, self.device)

    def shard_info(self) -> ShardInfo:
        return self.engine.shard_info()

    def teardown(self) -> None:
        """A survivor's shard released before it rejoins (`Workhorse.rejoin`): a snapshot write under
        way finishes (from its copy or the handed answer), the engine leaves its library's groups and is
        dropped. The snapshots held, the weight-sync groups with rollout shards (their own stores)
        and the transfer buffers stay."""
        import gc

        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.join()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
            del self.engine, engine
        gc.collect()
        if self.device == "gpu":
            torch.cuda.empty_cache()

    @fanout(dispatch="slice", collect="flatten", reads=forward_columns)
    def forward(self, batch: Batch, entropy: bool = False, adapters: bool = True,
                routing: bool = False) -> Batch | None:
        """LOGPROBS (and ENTROPY if asked) for a policy, VALUES for a critic; [b, T-1] per column.
        A LoRA model with `adapters=False` answers as its frozen base: the reference's log-probs.
        `routing`: a mixture of experts routes each token as the batch's ROUTED_EXPERTS say (routing
        replay); otherwise as it chooses."""
        if not adapters and self.engine.lora is None:
            raise ValueError(f"forward(adapters=False): the {self.role} trains no LoRA adapters; "
                             "score the reference with a reference model instead")
        out = self.engine.forward(batch, entropy=entropy, adapters=adapters)
        heap.give_back()  # the step's freed pages back to the node
        return None if out is None else Batch(dict(out))

    @fanout(dispatch="slice", collect=_replica_metrics, reads=train_step_columns)
    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step over the whole batch (each replica takes its slice), in micro-batches
        of `micro_batch_size` rows (default: the whole slice). `loss_fn(outputs, batch)` returns
        the loss, or (loss, metrics); give it a `reads` attribute to ship fewer columns."""
        metrics = self.engine.train_step(batch, loss_fn, micro_batch_size or len(batch))
        heap.give_back()  # the step's freed pages back to the node
        return metrics

    @fanout(dispatch="all", collect=_exported)
    def state_dict(self) -> dict | None:
        """The full weights with Hugging Face names, gathered to the exporting shard."""
        full: dict = {}
        for bucket in self.engine.export_weights(check=False):
            full.update(bucket)
        return full if self.engine.exports() else None

    @fanout(dispatch="all", collect=_exported, deadline_s=1800.0)
    def save_pretrained(self, directory: str) -> str | None:
        """Write the full weights (gathered from every TP/PP/ZeRO shard) as a Hugging Face directory
        that transformers and vLLM load, with the source model's config and tokenizer; returns it."""
        from xray.backends.hf_dir import save_hf_model

        full: dict = {}
        for bucket in self.engine.export_weights(check=False):
            full.update(bucket)
        if not self.engine.exports():
            return None
        return str(save_hf_model(full, self.config["model_dir"], directory))

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def state_bytes(self) -> dict[str, int]:
        """This shard's trainable-parameter and optimizer-state bytes, per shard."""
        return self.engine.state_bytes()

    @fanout(dispatch="all", collect=_exported, deadline_s=1800.0)
    def save_adapter(self, directory: str) -> str | None:
        """Write the LoRA adapters (gathered from every shard) as a `peft` adapter directory that
        `peft.PeftModel.from_pretrained` and vLLM load; returns it."""
        from xray.backends.lora import save_adapter

        tensors = self.engine.export_adapter()
        if not self.engine.exports():
            return None
        return str(save_adapter(directory, tensors, self.engine.lora, self.config["model_dir"]))

    def _buckets(self, bucket_bytes: int, replica: int, adapter: bool, check: bool = True):
        """What a sync sends: the full weights (merged, with LoRA) in buckets, or with `adapter`
        the LoRA tensors alone, in one bucket (they are small)."""
        if not adapter:
            yield from self.engine.export_weights(bucket_bytes, replica, check)
            return
        tensors = self.engine.export_adapter(replica)
        if tensors:
            yield list(tensors.items())

    def _takes_adapter(self, targets: list) -> bool:
        """Whether a sync to `targets` sends the adapters alone: this model trains LoRA adapters
        and the targets' engine serves them (vLLM built with the actor's `lora`); else merged
        weights (DeepSpeed-Inference). Asked once per set of targets, by every shard alike."""
        import ray

        if self.engine.lora is None:
            return False
        key = tuple(t._actor_id.hex() for t in targets)
        if key not in self._adapter_targets:
            self._adapter_targets[key] = all(ray.get([t.takes_adapter.remote() for t in targets]))
        return self._adapter_targets[key]

    @fanout(dispatch="all", collect=_exported, deadline_s=1800.0)
    def push_weights(self, targets: list, version: int, bucket_bytes: int = 64 << 20,
                     corrupt: str | None = None, replica: int = 0, transport: str = "auto",
                     verify: bool = True) -> dict | None:
        """Stream the full weights, bucket by bucket, to rollout Workhorses (Ray actor handles).

        Every shard takes part in the export (its gathers are collective); the exporting shard
        (the first of data-parallel replica `replica`: an asynchronous run's trainer d pushes to
        its own makers) sends each bucket once, with its tensors' checksums, by `transport`:
        "objstore" puts it in the object store in its wire form; "shm" copies it into this shard's
        shared-memory slots, which the targets map once (`xray/transport/shm.py`; same node, CPU);
        "ipc" copies it into this shard's GPU buffers and hands the targets their CUDA IPC handles
        (`xray/transport/ipc.py`; every target on this shard's own GPU); "pg" broadcasts it over a sync
        group of its own with the targets (`xray/transport/pg.py`, joined on first use). "auto" takes
        "shm" when every target is on this node on the CPU and /dev/shm has room (else the object
        store there), "ipc" when every target shares this shard's GPU, the object store when some
        do (NCCL cannot group two processes of one GPU), and the group otherwise.

        It exports the next bucket while the targets load this one: at most two buckets are in
        flight. The targets' `finish_sync` is queued behind the last one (`abort_sync` instead if
        the push fails), and the answer comes once the last bucket is sent, with the references of
        the targets' last loads and of their `finish_sync` reports (`loads`, `finishes`): the
        caller awaits those while this shard is free for its next call (the actor's side of the
        probe runs while the rollout still loads), and the engine's digest check of its export
        (`export`: `TrainEngine.export_check`, judged by `xray/sync/export_check.py`). `corrupt` breaks the sync on purpose
        (`xray/transport/faults.py`): a fault-injection knob for testing the verification, never set in a run.
        """
        import ray

        sent = count = 0
        dtype = None
        t0 = time.perf_counter()
        in_flight: list[list] = []
        manifest: list = []
        exports = self.engine.exports(replica)
        if exports:
            transport = self._transport(targets, transport, bucket_bytes)
            for t in targets:  # ahead of the first bucket (one caller: in order): whatever an earlier,
                t.abort_sync.remote()  # unfinished sync left is forgotten
        adapter = self._takes_adapter(targets)
        try:
            for bucket in self.timed(self._buckets(bucket_bytes, replica, adapter, verify)):
                if not exports or not bucket:
                    continue
                bucket = faults.on_export(bucket, corrupt)
                dtype = dtype or str(bucket[0][1].dtype).removeprefix("torch.")
                if len(in_flight) == 2:  # at most two buckets on their way: the oldest must land first
                    ray.get(in_flight.pop(0))
                in_flight.append(self._send(bucket, targets, transport, corrupt, verify))
                manifest += manifest_of(bucket)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                count += len(bucket)
        except BaseException:
            if exports:  # queued behind the loads sent: the targets forget this sync
                for t in targets:
                    t.abort_sync.remote()
            raise
        if not exports:
            return None
        # queued behind the loads (a Workhorse serves its calls in order), without a round trip
        # in between; a load that failed fails its replica's finish_sync too
        finishes = [t.finish_sync.remote(version) for t in targets]
        return {"version": version, "bytes": sent, "tensors": count, "replicas": len(targets),
                "push_s": time.perf_counter() - t0, "dtype": dtype, "transport": transport, "adapter": adapter,
                "export": None if adapter else self.engine.export_check(), "manifest": manifest, "loads": [ref for loads in in_flight for ref in loads], "finishes": finishes}

    def _transport(self, targets: list, transport: str, bucket_bytes: int) -> str:
        """The transport a push to `targets` takes (see `push_weights`, `choose_transport`)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; choose one of {', '.join(TRANSPORTS)}")
        same_node, same_gpu = self._place_of(targets)
        return choose_transport(transport, self.device == "gpu", same_node, same_gpu,
                                lambda: shm.usable(bucket_bytes))

    def _place_of(self, targets: list) -> tuple[bool, list[bool]]:
        """Whether every target is on this shard's node, and which share this shard's GPU (asked
        once per set of targets: their node and GPU UUID, `Workhorse.place`)."""
        import ray

        key = tuple(t._actor_id.hex() for t in targets)
        if key not in self._places:
            node, uuid = self.place()
            places = ray.get([t.place.remote() for t in targets])
            self._places[key] = (all(n == node for n, _ in places),
                                 [uuid is not None and (n, u) == (node, uuid) for n, u in places])
        return self._places[key]

    def _send(self, bucket, targets: list, transport: str, corrupt: str | None, verify: bool) -> list:
        """Send one bucket to every target by `transport`, with checksums when `verify` (the
        targets then check it: `xray.transport.wire.verified`) in the family the transport names
        for where the bytes lie ("xxh3" in host memory, "pw64" on a GPU: `xray/transport`);
        their pending loads."""
        import ray

        key = tuple(t._actor_id.hex() for t in targets)
        if transport == "ipc":  # device to device: the bucket never leaves the GPU
            if key not in self._ipc_rings:
                self._ipc_rings[key] = ipc.IpcRing(torch.device("cuda", torch.cuda.current_device()))
            ring = self._ipc_rings[key]
            if ring.loads[ring.next]:  # the buffer's last readers (of an earlier sync) must be done
                ray.wait(ring.loads[ring.next], num_returns=len(ring.loads[ring.next]), fetch_local=False)
            slot, handle, layout = ring.write(bucket, corrupt, checksums=verify)
            ring.loads[slot] = [t.load_ipc.remote(handle, layout) for t in targets]
            return ring.loads[slot]
        if transport == "pg":  # one flat buffer on this shard's device, checksummed there
            sync_group = self._sync_group(targets)
            flat, layout = pg.pack(bucket, "cuda" if self.device == "gpu" else "cpu", checksums=verify)
            layout = faults.in_buffer(flat, layout, corrupt)
            loads = [t.receive_bucket.remote(layout, flat.numel()) for t in targets]  # they wait in the broadcast
            pg.send(sync_group, flat)
            return loads
        wire = faults.in_transit(pack_bucket(bucket, checksums=verify), corrupt)  # host bytes, "xxh3"
        if transport == "objstore":
            ref = ray.put(wire)
            return [t.load_bucket.remote(ref) for t in targets]
        if key not in self._rings:
            self._rings[key] = shm.SendRing(f"{self.role}{self.rank}x{len(self._rings)}")
        ring = self._rings[key]
        if ring.loads[ring.next]:  # the slot's last readers (of an earlier sync) must be done
            ray.wait(ring.loads[ring.next], num_returns=len(ring.loads[ring.next]), fetch_local=False)
        slot, path, layout = ring.write(wire)
        ring.loads[slot] = [t.load_slot.remote(slot, path, layout) for t in targets]
        return ring.loads[slot]

    def _sync_group(self, targets: list):
        """The sync group of this shard (rank 0) and `targets` (ranks 1..n), joined on first use."""
        import ray

        key = tuple(t._actor_id.hex() for t in targets)
        if key not in self._groups:
            addr, port = self.address()
            world = 1 + len(targets)
            joins = [t.join_sync_group.remote(addr, port, rank + 1, world) for rank, t in enumerate(targets)]
            self._groups[key] = pg.join(addr, port, 0, world, "cuda" if self.device == "gpu" else "cpu")
            ray.get(joins)
            self.log.info("weight-sync group of %d ranks at %s:%d", world, addr, port)
        return self._groups[key]

    def shutdown(self) -> None:
        """Remove this shard's shared-memory slots, free its GPU buffers, then leave the process group."""
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        for buffers in self._ipc_rings.values():
            buffers.close()
        self._ipc_rings.clear()
        super().shutdown()

    @fanout(dispatch="all", collect=_exported, deadline_s=1800.0)
    def stage_weights(self, bucket_bytes: int = 64 << 20, replica: int = 0) -> dict | None:
        """Export the full weights into the object store, every bucket at once, and return their
        references (`{"buckets": [ref, ...], "bytes": n}` from the exporting shard): the weights of
        this instant, for rollout replicas to load whenever they are free (`xray.sync.deliver`).
        The object store holds the whole model until the references are dropped."""
        import ray

        refs, sent, dtype, manifest = [], 0, None, []
        exports = self.engine.exports(replica)
        if self.engine.lora is not None:
            raise ValueError("staged weight syncs (trainer.mode=async) do not carry LoRA adapters yet; "
                             "run LoRA with trainer.mode=sync")
        for bucket in self.engine.export_weights(bucket_bytes, replica):
            if exports and bucket:
                refs.append(ray.put(pack_bucket(bucket)))
                manifest += manifest_of(bucket)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                dtype = dtype or str(bucket[0][1].dtype).removeprefix("torch.")
        return {"buckets": refs, "bytes": sent, "dtype": dtype, "manifest": manifest,
                "export": self.engine.export_check()} if exports else None

    @fanout(dispatch="all", collect=lambda layout, results: max(results))
    def snapshot(self, directory: str, key: str | None = None) -> float:
        """A flash snapshot: this shard's state copied into host memory now, kept under `key` (the
        caller's, one per snapshot taken: two callers snapshot the same Workhorse, an asynchronous
        run's trainer every step and the driver at a checkpoint, and may name one directory; default
        `directory`) until `hand_snapshot` hands it over (the newest `KEPT_SNAPSHOTS` wait). Returns
        the seconds the copy blocked (the slowest shard's, collected)."""
        t0 = time.perf_counter()
        key, snapshots = key or directory, getattr(self, "_snapshots", {})
        snapshots.pop(key, None)
        while len(snapshots) >= KEPT_SNAPSHOTS:  # freed before the copy: never one more in memory
            snapshots.pop(next(iter(snapshots)))
        snapshots[key] = self.engine.snapshot(directory)
        snapshots[key].taken_as = self.rank  # a survivor's rank may change before a restore asks for it
        self._snapshots = snapshots
        return time.perf_counter() - t0

    @fanout(dispatch="all", collect=lambda layout, results: None)
    def hand_snapshot(self, key: str, missing_ok: bool = False) -> tuple[dict | None, int | None]:
        """The snapshot's files (path -> object) and the rank it was taken as, this call's two
        answers (the WholeModel actor calls it with two returns, `WholeModelActor.hand_snapshot`: it
        keeps the files' and awaits the rank's, which says the files are in the object store
        without fetching them; `missing_ok`: (None, None) when it holds no such snapshot, as
        `WholeModelActor.hand_kept` asks of every rank),
        after which this process keeps no copy of them (only what `persist_snapshot` runs after
        writing them: DeepSpeed's `latest` and recovery scripts): the object store keeps the files
        for their owner (the WholeModel actor) after this process dies, a replacement reads them in
        `load`, a disk write reads them in place. Tensors travel as numpy arrays (`to_wire`): no
        copy beyond the object store's, and a reader on this node maps them. The copy is one block
        (`host_copy`), freed as a whole once the object store has it."""
        from xray.backends.snapshot import Snapshot, to_wire

        snapshot = getattr(self, "_snapshots", {}).pop(key, None)
        if snapshot is None and missing_ok:
            return None, None
        if snapshot is None:
            raise RuntimeError(f"hand_snapshot: no snapshot {key} waits to be handed; take it first")
        handed = self._handed = getattr(self, "_handed", {})
        handed[key] = Snapshot([], snapshot.finish, snapshot.markers)
        while len(handed) > 2 * KEPT_SNAPSHOTS:
            handed.pop(next(iter(handed)))
        return to_wire(snapshot.held()), snapshot.taken_as

    @fanout(dispatch="all", collect=lambda layout, results: None)
    def persist_snapshot(self, key: str, handed: list) -> None:
        """Write snapshot `key` to disk from a background thread while training goes on (after the
        previous write: one at a time): from `handed`, every rank's `hand_snapshot` answer (this
        rank's read where it lies), and what the hand kept here (the files written after them)."""
        import threading

        from xray.backends.snapshot import Snapshot

        snapshot = getattr(self, "_handed", {}).get(key)
        if snapshot is None:
            raise RuntimeError(f"persist_snapshot: no snapshot {key} was handed here; hand it first")
        self.wait_persisted()
        self._persist_error: BaseException | None = None

        def write() -> None:  # a failure, reading the answer included, is persisted()'s to report
            try:
                files = _fetch(handed[self.rank], copy=False).items()  # a marker (str) is finish's to write
                Snapshot([(path, v) for path, v in files if not isinstance(v, str)], snapshot.finish)()
            except BaseException as exc:  # noqa: BLE001 - reported by persisted()
                self._persist_error = exc

        self._writer = threading.Thread(target=write, name=f"persist-{self.role}-{self.rank}", daemon=True)
        self._writer.start()

    @fanout(dispatch="all", collect=lambda layout, results: all(results))
    def persisted(self) -> bool:
        """Whether the last snapshot is on disk (its write's error, if it failed)."""
        writer = getattr(self, "_writer", None)
        if writer is not None and not writer.is_alive() and self._persist_error is not None:
            raise self._persist_error
        return writer is None or not writer.is_alive()

    @fanout(dispatch="all", collect=lambda layout, results: all(results))
    def wait_persisted(self) -> bool:
        """Block until the last snapshot is on disk."""
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.join()
        return self.persisted()

    @fanout(dispatch="all", collect=lambda layout, results: None)
    def save(self, directory: str) -> None:
        self.engine.save(directory)

    @fanout(dispatch="all", collect=lambda layout, results: "memory" if set(results) == {"memory"} else "disk")
    def load(self, directory: str, held: list | None = None, saved=None, peers: dict | None = None) -> str:
        """Restore the checkpoint in `directory`. `held`: the references of every rank's
        `hand_snapshot` answer for it, taken in layout `saved` (None: this one); where a rank's
        node was lost, Ray reads the copy pinned on another node (`xray/run/snapshot_holder.py`),
        or `peers` names the data-parallel peer whose file stands in for it (`TrainEngine.as_rank`).
        In this layout this rank's and rank 0's files are read from memory; in another, the
        files resharding needs (Megatron: the first replica's; DeepSpeed: every rank's). Whatever
        cannot be fetched is read from the disk. Returns where the files came from ("memory" only
        if every shard's did)."""
        files, complete = None, held is not None and saved is not None and saved != self.parallel
        if held is not None:
            wanted = set(self.engine.restore_ranks(saved)) if complete else {0, self.rank}
            try:
                fetched: dict = {}
                for r in sorted(wanted):
                    source = (peers or {}).get(r, r)
                    got = _fetch(held[source])
                    fetched.update(got if source == r else self.engine.as_rank(got, directory, source, r))
                files = fetched  # all of them, or none: the disk then has them all
            except Exception as exc:  # noqa: BLE001 - lost with its node: the disk has it
                self.log.warning("the in-memory snapshot is gone (%s); loading %s from disk",
                                 str(exc).splitlines()[0], directory)
        self.engine.load(directory, files, complete=complete and files is not None)
        return "memory" if files is not None else "disk"

