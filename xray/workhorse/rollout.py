"""RolloutWorkhorse: one replica of the rollout engine (vLLM or DeepSpeed-Inference).

Each Workhorse holds one in-process generation engine (`xray.backends.vllm` / `.dsinfer`), one
tensor-parallel rank of one replica (ranks in Megatron order: tp fastest). Weight sync arrives
as buckets of full Hugging Face tensors sent by the actor's exporting shard (`load_bucket`,
`load_slot`, `load_ipc` or `receive_bucket`, by transport: each recomputes every tensor's checksum
where its copy lies, in the family the sender named, which must be its transport's,
`xray/transport`), then `finish_sync` reports what arrived and what the engine was seen to hold,
and bumps the weight version that every generation result carries in `meta["weight_version"]`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from xray.backends import load_backend
from xray.backends.base import GenerationEngine, ShardInfo, layout_of
from xray.backends.sampling import ROUTED_EXPERTS_ROWS
from xray.config.engines import engine as engine_row
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.sequences import pack_sequences
from xray.data.stops import stop_token_ids
from xray.protocol import fanout
from xray.transport.wire import changed_in_transit, manifest_of, unpack_bucket, verified
from xray.workhorse.base import Workhorse


class RolloutWorkhorse(Workhorse):
    """A replica of a generation engine."""

    engine: GenerationEngine

    def __init__(self, role: str, rank: int, parallel, seed: int = 0, **kwargs: Any):
        super().__init__(role, rank, parallel, seed=seed, **kwargs)
        self.version = 0
        self._sync_started = 0.0
        self._received = 0
        self._changed: list[str] = []
        self._got: list = []  # what the sync under way loaded, in order (duplicates kept): manifest entries
        self._failed = ""  # why a bucket of the sync under way did not load
        self._slots = None  # the actor's shared-memory slots, once mapped (`xray/transport/shm.py`)

    def init_dist(self, master_addr: str, master_port: int, timeout_s: float = 300.0) -> None:
        """Join the role's group when the engine needs one: DeepSpeed-Inference always (AutoTP
        groups), vLLM only for tensor parallelism (with tp=1 it builds its own world of one), and
        then in a world of its replica's tp shards alone (`replica_world`): the registry's
        `replica_world` fact of the engine."""
        own_world = engine_row(self.config["backend"]).replica_world
        if own_world and self.parallel.tp == 1:
            return
        if getattr(self, "_alone", False):
            self.alone_world(master_addr, master_port, timeout_s)
            return
        super().init_dist(master_addr, master_port, timeout_s)
        if own_world and self.parallel.dp > 1:
            self.replica_world(timeout_s)

    def replica_world(self, timeout_s: float) -> None:
        """vLLM's `external_launcher` takes the default group as its tensor-parallel world, so each
        replica needs a world of its own tp processes: the model's group of all shards only carries
        each replica's rendezvous point (its tp rank 0's address) to the replica's shards, then
        gives way to the replica's own group."""
        import torch.distributed as dist

        from xray.transport.rendezvous import join_world

        c = self.parallel.coords(self.rank)
        points: list = [None] * self.parallel.world_size
        dist.all_gather_object(points, self.address() if c.tp_rank == 0 else None)
        addr, port = points[self.parallel.rank_of(0, 0, c.dp_rank)]
        backend = dist.get_backend()
        dist.destroy_process_group()
        join_world(backend, addr, port, c.tp_rank, self.parallel.tp, timeout_s)
        self.log.info("replica %d: its own group of %d at %s:%d", c.dp_rank, self.parallel.tp, addr, port)

    def start_alone(self, master_addr: str, master_port: int) -> ShardInfo:
        """`start` for a replica restarted on its own (`WholeModel.restart_replica`): its shards
        join a world of their own (the replica's tp shards, at its first shard's address), since
        the other replicas' shards are busy generating and never talk to this one."""
        self._alone = True
        return self.start(master_addr, master_port)

    def alone_world(self, addr: str, port: int, timeout_s: float) -> None:
        """The default group of a replica restarted alone: its tp shards, ranked by tp rank."""
        from xray.transport.rendezvous import join_world

        c = self.parallel.coords(self.rank)
        join_world("nccl" if self.device == "gpu" else "gloo", addr, port, c.tp_rank, self.parallel.tp, timeout_s)
        self.log.info("replica %d restarted alone: its own group of %d at %s:%d", c.dp_rank, self.parallel.tp,
                      addr, port)

    def shard_info(self) -> ShardInfo:
        return layout_of(self.parallel, self.rank)

    def setup(self) -> None:
        cfg = dict(self.config)
        backend = cfg.pop("backend")
        model_dir = cfg.pop("model_dir")
        self.engine = load_backend(backend).build_engine(
            model_dir, seed=self.seed, tp=self.parallel.tp, device="cuda" if self.device == "gpu" else "cpu",
            **cfg)
        self.log.info("%s replica %d ready", backend, self.rank)

    @fanout(dispatch="slice", collect="flatten")
    def generate(self, prompts: list, sampling: dict | None = None, pad_id: int | None = None) -> Batch:
        """Responses for this replica's prompts (token-id lists, or text when the model directory
        has a tokenizer: then the answer also holds `prompt_text` and `completion`, and the
        responses stop at the model's EOS ids unless `stop_token_ids` says otherwise); rows carry
        the weight version. `sampling`: temperature, top_p, top_k, max_new_tokens, n,
        stop_token_ids, stop (strings: an engine built with `stop_strings`), seed (defaults: the
        engine's). With `pad_id`, also the model inputs
        (INPUT_IDS, ATTENTION_MASK, LOSS_MASK, and the engine's BEHAVIOUR_LOGPROBS, as
        `xray.data.sequences.pack_sequences` lays them out), so the answer can go by reference
        straight to the forwards of other WholeModels."""
        texts = prompts if prompts and isinstance(prompts[0], str) else None
        sampling = dict(sampling or {})
        if texts is not None:
            prompts = [self.tokenizer(t).input_ids for t in texts]
            sampling.setdefault("stop_token_ids", stop_token_ids(self.tokenizer, self.config["model_dir"]))
        out = self.engine.generate(prompts, sampling)
        out.meta["weight_version"] = self.version
        if texts is not None:
            out["prompt_text"] = [t for t in texts for _ in range(len(out) // len(texts))]
            out["completion"] = self.tokenizer.batch_decode(list(out[C.RESPONSE_IDS]), skip_special_tokens=True)
        routed = out.lists.pop(ROUTED_EXPERTS_ROWS, None)  # laid out with the model inputs, or dropped
        if pad_id is not None:
            packed = pack_sequences(out[C.PROMPT_IDS], out[C.RESPONSE_IDS], pad_id, out["response_logprobs"],
                                    routed_experts=routed)
            out.tensors.update(packed.tensors)
        return out

    @property
    def tokenizer(self):
        """The model directory's tokenizer (for text prompts), loaded on first use."""
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.config["model_dir"])
            except (OSError, ValueError) as exc:
                raise ValueError(f"text prompts need a tokenizer in {self.config['model_dir']} ({exc}); "
                                 "pass token-id lists instead") from None
        return self._tokenizer

    @fanout(dispatch="slice", collect="flatten")
    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """The engine's own log-probs of each sequence's tokens after its prompt."""
        return self.engine.logprobs(sequences, prompt_lens)

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def weight_version(self) -> int:
        return self.version

    # -- weight sync: called directly by the actor's exporting shard, bucket by bucket ----------
    def load_bucket(self, wire: list) -> int:
        """Load one bucket in its wire form (`xray.transport.wire.pack_bucket`) in place."""
        if not self._sync_started:
            self._sync_started = time.perf_counter()
        with self.busy("load_bucket"), self._noting_failure():
            self._take(unpack_bucket(wire), changed_in_transit(wire), verified(wire))
        return len(wire)

    def _take(self, bucket, changed: list[str], check: bool) -> None:
        """Load a bucket received (its tensors whose bytes `changed` in transit noted), checking
        what the engine then holds when the sync is verified (`check`); what it got is noted for
        `finish_sync` (names, dtypes, shapes, bytes: the receiver's side of the manifest)."""
        self._changed += changed
        self.engine.load_weights(bucket, check=check)
        got = manifest_of(bucket)
        self._got += got
        self._received += sum(entry[3] for entry in got)

    @contextmanager
    def _noting_failure(self) -> Iterator[None]:
        """Note an exception of a bucket's load for `finish_sync` (queued behind it) and re-raise."""
        try:
            yield
        except Exception as e:
            self._failed = self._failed or f"{type(e).__name__}: {e}"
            raise

    def join_sync_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the actor's sync group as `rank` (`xray/transport/pg.py`; the actor's exporting shard
        is rank 0 and serves its store at addr:port)."""
        from xray.transport import pg

        self._sync_group = pg.join(addr, port, rank, world, "cuda" if self.device == "gpu" else "cpu")

    def receive_bucket(self, layout: list, size: int) -> int:
        """Receive one bucket of `size` bytes broadcast over the sync group and load it in place
        (its `layout` came ahead: names, dtypes, shapes, offsets, byte counts and checksums, in the
        family of this shard's device, `xray/transport/pg.py`)."""
        from xray.transport import pg

        if not self._sync_started:
            self._sync_started = time.perf_counter()
        with self.busy("receive_bucket"), self._noting_failure():
            bucket, changed = pg.receive(self._sync_group, layout, size, "cuda" if self.device == "gpu" else "cpu")
            self._take(bucket, changed, verified(layout))
        return len(layout)

    def load_slot(self, slot: int, path: str, layout: list) -> int:
        """Load the bucket the actor's exporting shard copied into its shared-memory `slot` at
        `path` (`xray/transport/shm.py`: mapped on first use, then kept), in place."""
        from xray.transport import shm

        if not self._sync_started:
            self._sync_started = time.perf_counter()
        if self._slots is None:
            self._slots = shm.SlotReader()
        with self.busy("load_slot"), self._noting_failure():
            self._take(*self._slots.read(slot, path, layout), verified(layout))
        return len(layout)

    def load_ipc(self, handle: tuple, layout: list) -> int:
        """Load the bucket the actor's exporting shard copied into its GPU buffer behind the CUDA
        IPC `handle` (`xray/transport/ipc.py`: this shard is on the actor's GPU), in place; the copies
        out of the buffer are finished before this returns (the actor then reuses it)."""
        import torch

        from xray.transport import ipc

        if not self._sync_started:
            self._sync_started = time.perf_counter()
        with self.busy("load_ipc"), self._noting_failure():
            self._take(*ipc.views(ipc.open_handle(handle), layout), verified(layout))
            torch.cuda.synchronize()
        return len(layout)

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def time_reload(self, repeats: int = 5) -> float:
        """Median seconds of the engine's own in-place reload (`VllmEngine.reload`) of its model
        directory's tensors, read into memory first: the floor a weight sync is measured against
        (benchmarks/weight_sync.py). The engine then holds the directory's weights."""
        import statistics

        from safetensors.torch import load_file

        if not hasattr(self.engine, "reload"):
            raise ValueError("time_reload measures vLLM's in-place reload; this rollout is not vLLM")
        tensors = {}
        for path in sorted(Path(self.config["model_dir"]).glob("*.safetensors")):
            tensors.update(load_file(str(path)))
        bucket = list(tensors.items())
        self.engine.reload(bucket)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.engine.reload(bucket)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def takes_adapter(self) -> bool:
        """Whether this engine serves the actor's LoRA adapter synced alone (`xray/backends/vllm_adapter.py`)."""
        return self.engine.takes_adapter()

    def finish_sync(self, version: int) -> dict:
        """Mark the sync complete at `version`; returns what this replica received and its exact
        checks (`xray.sync.weights.check_exact` judges them): tensors whose bytes changed in
        transit, what the engine was seen to hold (`xray/backends/held.py`; a quantized engine's
        fp8 layers against our quantization of the tensors received) and the engine tensors its
        loads wrote (`held_tensors`: the coverage of the held check), and for the completeness
        check the names loaded (in order) with the dtype, shape and byte count each arrived in, the
        names the engine needs and takes, and those it still holds back (a fused layer incomplete)."""
        if self._failed:
            why, self._failed, self._received, self._sync_started, self._changed = self._failed, "", 0, 0.0, []
            self._got = []
            raise RuntimeError(f"weight sync to version {version} failed on rollout replica {self.rank}: a bucket "
                               f"did not load ({why}). The replica keeps version {self.version} with its weights "
                               "partly updated: sync again before generating")
        with self.busy("finish_load"):
            self.engine.finish_load()  # an adapter received is applied now
        report = {"rank": self.rank, "bytes": self._received, "version": version,
                  "load_s": time.perf_counter() - self._sync_started if self._sync_started else 0.0,
                  "dtype": self.config.get("dtype", "float32"), "changed_in_transit": self._changed,
                  "quantization": self.config.get("quantization", "none"),
                  "held": self.engine.held_check(), "holds": self.engine.held_tensors(),
                  "loaded": [entry[0] for entry in self._got], "received": self._got,
                  "names": self.engine.weight_names(), "waiting": self.engine.drop_pending(),
                  "not_reloaded": self.engine.not_reloaded()}
        self.version, self._received, self._sync_started, self._changed, self._got = version, 0, 0.0, [], []
        return report

    def abort_sync(self) -> None:
        """Forget the sync under way (what was received, loaded, changed in transit or failed to
        load, and what the engine holds back or counted): the actor's push stopped before queueing
        `finish_sync`. Every sender also queues it ahead of a sync's first bucket, so that one left
        unfinished (a sender that died or was cancelled between its loads and `finish_sync`)
        cannot count in the next. The replica keeps its version, its weights partly updated,
        until the next sync."""
        self._received, self._sync_started, self._changed, self._failed, self._got = 0, 0.0, [], "", []
        self.engine.drop_pending()
        self.engine.not_reloaded()
        self.engine.held_check()
        self.engine.held_tensors()

    # -- sleep mode (`rollout.sleep`): the engine's GPU memory freed while training roles use it --
    @fanout(dispatch="all", collect=lambda layout, results: results)
    def sleep(self) -> bool:
        """Free the engine's GPU memory until `wake_up` (vLLM built with sleep mode; a no-op
        otherwise, and always on CPU). True on shards that sleep now."""
        return self.engine.sleep()

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def wake_up(self) -> bool:
        """Take the engine's GPU memory back before generating or loading weights; a no-op when
        awake. True on shards that were asleep."""
        return self.engine.wake_up()
