"""DeepSpeedEngine: one data-parallel shard of a Hugging Face model trained with DeepSpeed ZeRO.

Sits in the DeepSpeed training backend (`load_backend("deepspeed")`); a Workhorse holds one per
device. The process's torch.distributed default group must already span exactly this model's
shards (the Workhorse makes it; tests use `tests/dist_harness.py`); DeepSpeed reuses it, over gloo
on CPU and NCCL on GPU. Layout: tp = pp = 1, dp = world size; ZeRO stage 1 shards optimizer
state, stage 2 also gradients, stage 3 also parameters.

Update arithmetic: xray's torch AdamW and linear warm-up (`xray.backends.optim`) are passed to
DeepSpeed as its client optimizer and scheduler, so one step matches `xray.check.reference` to
rounding. A step's gradient is the mean of the loss over all micro-batches of all replicas:
DeepSpeed divides each micro-batch's loss by the accumulation steps and averages over replicas.
"""
from __future__ import annotations

import contextlib
import dataclasses

import logging
import os
import tempfile
from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist

from xray.backends.base import LossFn, OptimConfig, ShardInfo, TrainEngine, WeightBucket, apply_loss, layout_of
from xray.backends.deepspeed.config import ZeroOptions, deepspeed_config
from xray.backends.deepspeed.export import adapter_tensors, iter_weight_buckets
from xray.backends.deepspeed.lora import adapters_off
from xray.backends.deepspeed.model import ROUTER_AUX, load_model, role_outputs, router_aux_coef
from xray.backends.deepspeed.reshard import client_state, ensure_universal, load_universal, saved_dp
from xray.backends.export_digest import ExportCheck
from xray.backends.optim import (ABORT, SKIPPED, build_optimizer, build_scheduler, follow_configured_lr, frozen_lr,
                                 skips_update)
from xray.backends.optim import state_bytes as optim_state_bytes
from xray.backends.snapshot import Snapshot, capture_engine, file_key, held_or_on_disk, read, replay_engine, stage_held
from xray.config.lora import LoraConfig
from xray.config.moe import MoeConfig
from xray.config.parallel import LayoutError, ParallelDims
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.budget import forward_micro_batches, restored
from xray.data.lengths import train_micro_batches

logger = logging.getLogger(__name__)

_RNG_FILE = "xray_rng_rank{rank}.pt"


class EngineSetupError(RuntimeError):
    """The process is not ready for a DeepSpeed engine; the message says what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message says what to do."""


class DeepSpeedEngine(TrainEngine):
    """Forward, train step, weight export and checkpoints of one ZeRO shard."""

    def __init__(self, model_dir: str, parallel: ParallelDims, role: str, optim: OptimConfig, seed: int,
                 zero_stage: int, device: str = "cpu", options: ZeroOptions = ZeroOptions(),
                 forward_micro_batch_size: int | None = None, lora: LoraConfig | None = None,
                 max_tokens_per_micro_batch: int | None = None, packing: bool = False,
                 moe: MoeConfig = MoeConfig(), activation_checkpointing: bool = False):
        _check_process(parallel, device)
        if activation_checkpointing and moe.routing_replay:
            raise EngineSetupError("activation_checkpointing with moe.routing_replay: the backward's recompute "
                                   "would route anew instead of replaying the rollout's routing; turn one of them off")
        self.max_tokens, self.packing = max_tokens_per_micro_batch, packing
        self.router_aux = router_aux_coef(model_dir, moe)  # 0: no load-balancing loss
        self.lora = lora if role != "reference" else None
        self.forward_micro_batch_size = forward_micro_batch_size
        self.role, self.zero_stage, self.device = role, zero_stage, device
        self.rank = dist.get_rank()
        self.parallel = parallel
        self.step_count = 0
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", dist_init_required=False)
        dtype = torch.bfloat16 if options.dtype == "bfloat16" else torch.float32
        torch.manual_seed(seed)
        trains = role != "reference"
        config = deepspeed_config(zero_stage, optim, parallel.dp, _hidden_size(model_dir), options, trains)
        module = load_model(model_dir, role, seed, dtype, zero3_config=config if zero_stage == 3 else None,
                            lora=self.lora, packing=packing, checkpointing=activation_checkpointing and trains)
        _place(module, device)
        trainable = [p for p in module.parameters() if p.requires_grad]  # with LoRA: the adapters
        optimizer = build_optimizer(trainable, optim) if trains else None
        scheduler = build_scheduler(optimizer, optim) if trains else None
        self.optim_lr = optim.lr
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False)
        torch.manual_seed(seed + self.rank)  # per-rank stream for anything random in training
        logger.info("role=%s rank=%d dp=%d ZeRO-%d built from %s", role, self.rank, parallel.dp, zero_stage, model_dir)

    # ---- contract ---------------------------------------------------------------------------

    def shard_info(self) -> ShardInfo:
        return layout_of(self.parallel, self.rank)

    def exports(self, replica: int = 0) -> bool:
        return self.rank == replica  # every rank is one data-parallel replica

    @torch.no_grad()
    def forward(self, batch: Batch, entropy: bool = False, adapters: bool = True) -> dict[str, torch.Tensor] | None:
        self.engine.eval()
        off = adapters_off(self.engine.module) if self.lora is not None and not adapters else contextlib.nullcontext()
        if self.max_tokens is not None:  # ZeRO-3 gathers in every forward: the ranks agree on a count
            micro, order = forward_micro_batches(batch, self.max_tokens, _largest_count, self.packing)
        else:
            micro, order = batch.micro_batches(self.forward_micro_batch_size), None
        with off:
            outs = [{k: v.detach().cpu() for k, v in role_outputs(self.engine, mb.to(self._device()), self.role,
                                                                  entropy, self.packing).items()} for mb in micro]
        if order is not None:
            return restored(outs, order, batch[C.INPUT_IDS].shape[1] - 1)
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        if self.optimizer is None:
            raise EngineSetupError(f"the {self.role} engine has no optimizer; build an actor or critic to train")
        micro = [mb.to(self._device()) for mb in train_micro_batches(
            batch, loss_fn, micro_batch_size, replicas=self.parallel.dp, max_tokens=self.max_tokens,
            agree=_largest_count, packed=self.packing)]  # ZeRO gathers and reduces in every micro-step: one count on all ranks
        self._set_accumulation(micro_batch_size if self.max_tokens is None else 1, len(micro))
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.engine.train()
        sums: dict[str, float] = {}
        skipped = False
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            self.engine.set_gradient_accumulation_boundary(last)
            outputs = role_outputs(self.engine, mb, self.role, packed=self.packing, router_aux=self.router_aux > 0)
            aux = outputs.pop(ROUTER_AUX, None)
            loss, metrics = apply_loss(loss_fn, outputs, mb)
            if aux is not None:  # the policy's loss and the router's, weighted
                loss = loss + self.router_aux * aux
                metrics = {**metrics, "router_aux_loss": float(aux.detach())}
            self.engine.backward(loss)
            for k, v in {"loss": float(loss.detach()), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v) / len(micro)
            if last and (SKIPPED in sums or ABORT in sums):  # the optimizer steps here: all ranks agree first
                agreed = _mean_over_ranks({k: sums[k] for k in (SKIPPED, ABORT) if k in sums})
                skipped = skips_update(agreed.get(SKIPPED), agreed.get(ABORT))
            with frozen_lr(self.optimizer, skipped):
                self.engine.step()
        self.step_count += 1
        averaged = _mean_over_ranks(sums)
        norm = self.engine.get_global_grad_norm()
        averaged.update(grad_norm=float(norm) if norm is not None else float("nan"), lr=lr,
                        update_skipped=float(skipped))
        return averaged

    def export_weights(self, bucket_bytes: int = 64 << 20, replica: int = 0,
                       check: bool = True) -> Iterator[WeightBucket]:
        if self.zero_stage == 3:
            # A forward-only pass leaves ZeRO-3's prefetched parameters in flight; gathering them
            # again then fails ("Cannot partition a param in flight"). Release them first.
            self.engine.empty_partition_cache()
        scaling = self.lora.scaling if self.lora is not None else None
        verdict = ExportCheck() if check else None
        self._export_check = verdict if self.exports(replica) else None
        return iter_weight_buckets(self.engine.module, bucket_bytes, self.zero_stage == 3, self.exports(replica),
                                   scaling, replica, verdict)

    def state_bytes(self) -> dict[str, int]:
        return optim_state_bytes(self.engine.module.parameters(), self.optimizer)

    def close(self) -> None:
        """DeepSpeed's engine released (its optimizer's buffers and hooks) and the default group
        left through DeepSpeed's own `destroy_process_group`, which drops the groups it cached over
        it (`deepspeed.utils.groups`: the world clone, data and expert groups); ZeRO-3's numbering
        starts again (`_restart_zero3_numbering`)."""
        self.engine.destroy()
        deepspeed.comm.destroy_process_group()
        _restart_zero3_numbering()

    def export_adapter(self, replica: int = 0) -> dict[str, torch.Tensor] | None:
        if self.lora is None:
            return super().export_adapter(replica)
        if self.zero_stage == 3:
            self.engine.empty_partition_cache()
        return adapter_tensors(self.engine.module, self.zero_stage == 3, self.exports(replica))

    def save(self, directory: str) -> None:
        tag = f"step{self.step_count}"
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state(self.step_count))
        torch.save(self._rng(), os.path.join(directory, tag, _RNG_FILE.format(rank=self.rank)))
        dist.barrier()

    def snapshot(self, directory: str) -> Snapshot:
        """DeepSpeed's own checkpoint, taken into host memory through a capture engine."""
        tag, capture = f"step{self.step_count}", capture_engine()
        writer, self.engine.checkpoint_engine = self.engine.checkpoint_engine, capture
        scripts: list[str] = []  # DeepSpeed's recovery scripts (rank 0): copied with the files, not now
        self.engine._copy_recovery_script = scripts.append
        try:
            self.engine.save_checkpoint(directory, tag=tag, client_state=client_state(self.step_count),
                                        save_latest=False)
        finally:
            self.engine.checkpoint_engine = writer
            del self.engine._copy_recovery_script
        rng_file = (os.path.join(directory, tag, _RNG_FILE.format(rank=self.rank)), self._rng())
        engine = self.engine

        def latest() -> None:  # DeepSpeed's "latest", last: this shard's files are all in
            for path in scripts:
                engine._copy_recovery_script(path)
            with open(os.path.join(directory, "latest"), "w") as f:
                f.write(tag)
        return Snapshot([*capture.files, rng_file], latest if self.rank == 0 else None,
                        {os.path.join(directory, "latest"): tag})

    def _rng(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def load(self, directory: str, held: dict | None = None, complete: bool = False, _staged: bool = False) -> None:
        """Restore a checkpoint of this role, saved at this data-parallel size (its files read from
        `held` when it holds them) or at another (then through DeepSpeed's universal checkpoint:
        `xray/backends/deepspeed/reshard.py`). A snapshot that never reached the disk, or one of
        another size held `complete` (every rank's files), is staged in a temporary directory first,
        as DeepSpeed looks for its files there (and converts them there, on every rank)."""
        trains = self.optimizer is not None
        latest = os.path.join(directory, "latest")
        if held and file_key(latest) in held and (complete or not os.path.isfile(latest)):
            with tempfile.TemporaryDirectory(prefix="xray-snapshot-") as staged:  # DeepSpeed globs the disk
                return self.load(stage_held(directory, held, staged), complete=complete, _staged=True)
        if not held_or_on_disk(latest, held):
            raise CheckpointError(f"no DeepSpeed checkpoint in {directory} (no 'latest' file); "
                                  "pass the directory given to save()")
        if held and file_key(latest) in held:  # a snapshot in memory, handed over in this layout only
            tag, saved = held[file_key(latest)], self.parallel.dp
        else:
            with open(latest) as f:
                tag = f.read().strip()
            # staged in this layout: this rank's and rank 0's files only
            saved = self.parallel.dp if _staged and not complete else saved_dp(directory, tag)
        if saved and saved != self.parallel.dp and tag == "step0":
            # before the first optimizer step the checkpoint holds the weights this engine was
            # built with and an empty Adam state, which DeepSpeed's converter cannot read: keep them
            client = {"xray_step": 0}
            logger.info("a dp=%d checkpoint from before any optimizer step, at dp=%d: the built weights stand",
                        saved, self.parallel.dp)
        elif saved and saved != self.parallel.dp:
            ensure_universal(directory, tag, 0 if _staged else self.rank)  # staged: each rank its own copy
            _, client = load_universal(self.engine, directory, trains)
            client = client or torch.load(os.path.join(directory, tag, "mp_rank_00_model_states.pt"),
                                          map_location="cpu", weights_only=False)
            logger.info("restored a dp=%d checkpoint at dp=%d (universal checkpoint)", saved, self.parallel.dp)
        else:
            reader, self.engine.checkpoint_engine = self.engine.checkpoint_engine, replay_engine(held or {})
            try:
                _, client = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=trains,
                                                        load_lr_scheduler_states=trains)
            finally:
                self.engine.checkpoint_engine = reader
        if trains:
            follow_configured_lr(self.scheduler, self.optim_lr)
        self.step_count = int(client.get("xray_step", 0))
        rng_rank = self.rank % saved if saved else self.rank  # another dp: a saved rank's stream
        rng_path = os.path.join(directory, tag, _RNG_FILE.format(rank=rng_rank))
        if not held_or_on_disk(rng_path, held):
            raise CheckpointError(f"{rng_path} is missing: the checkpoint was not written by xray")
        rng = read(rng_path, held, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

    # ---- helpers ----------------------------------------------------------------------------

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else self.engine.device

    def _set_accumulation(self, micro_batch_size: int, micro_batches: int) -> None:
        """Tell DeepSpeed this step's batch: it scales each micro-batch's loss by 1/micro_batches."""
        self.engine.set_train_micro_batch_size(micro_batch_size)
        self.engine.set_train_batch_size(micro_batch_size * micro_batches * self.parallel.dp)


def _check_process(parallel: ParallelDims, device: str) -> None:
    if not dist.is_initialized():
        raise EngineSetupError("torch.distributed is not initialised; create the default group over this "
                               "model's shards first (the Workhorse does; tests use tests/dist_harness.py)")
    if parallel.tp != 1 or parallel.pp != 1:
        raise LayoutError(f"the DeepSpeed engine is data-parallel only, got tp={parallel.tp} pp={parallel.pp}; "
                          "use tp=1 pp=1, or the megatron backend for tensor/pipeline parallelism")
    if parallel.world_size != dist.get_world_size():
        raise LayoutError(f"dp={parallel.dp} but the default group has {dist.get_world_size()} ranks; "
                          "set dp to the number of processes in the group")
    if device not in ("cpu", "cuda"):
        raise EngineSetupError(f"device={device!r}; use 'cpu' or 'cuda'")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise EngineSetupError("device='cuda' but CUDA is not available; use device='cpu'")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))


def _place(module: torch.nn.Module, device: str) -> None:
    """Move the parameters ZeRO-3's loading has not placed (all of them on stages 1 and 2) to `device`."""
    if device == "cpu":
        return
    target = torch.device(device, torch.cuda.current_device())
    for p in module.parameters():
        if not hasattr(p, "ds_id"):
            p.data = p.data.to(target)
    for b in module.buffers():
        b.data = b.data.to(target)


def _hidden_size(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).hidden_size)


def _on_collective_device(t: torch.Tensor) -> torch.Tensor:
    """`t` where the default group's collectives take it (NCCL: the GPU)."""
    return t.cuda() if dist.get_backend() == "nccl" else t


def _largest_count(count: int) -> int:
    """The largest of every rank's micro-batch count (collective)."""
    t = _on_collective_device(torch.tensor([count], dtype=torch.long))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average float metrics over all ranks (every rank must pass the same keys)."""
    keys = sorted(values)
    t = _on_collective_device(torch.tensor([values[k] for k in keys], dtype=torch.float64))
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.cpu().tolist()))


def _restart_zero3_numbering() -> None:
    """ZeRO-3 numbers the parameters it partitions (`Init.param_id`) and the modules it hooks (the
    counter that `DeepSpeedZeRoOffload._register_deepspeed_module` keeps in its default argument)
    process-wide, and ranks compare those ids when they fetch: both start again at 0, as in a new
    process, or a rebuilt shard's ids would disagree with a new peer's (`TrainEngine.close`). Should
    a DeepSpeed release move them, this fails here (and the recovery tests with it)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    (modules,) = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    modules[0] = 0


def build_engine(model_dir: str, parallel: ParallelDims, role: str, optim: OptimConfig, seed: int,
                 zero_stage: int, device: str = "cpu", options: ZeroOptions = ZeroOptions(),
                 forward_micro_batch_size: int | None = None, dtype: str | None = None,
                 lora: LoraConfig | None = None, max_tokens_per_micro_batch: int | None = None,
                 packing: bool = False, moe: MoeConfig = MoeConfig(),
                 activation_checkpointing: bool = False) -> DeepSpeedEngine:
    """The DeepSpeed engine of this process's shard (see DeepSpeedEngine); `forward` runs in
    micro-batches of at most `forward_micro_batch_size` rows (None: the whole batch at once);
    `dtype` ("float32" or "bfloat16", DeepSpeed's bf16 with fp32 master weights) overrides the
    options' dtype; `lora` trains adapters only (`xray/backends/deepspeed/lora.py`);
    `max_tokens_per_micro_batch` cuts forwards and length-grouped train steps by that token
    budget instead of by rows (`xray/data/budget.py`); `packing` runs each micro-batch's rows as
    one sequence without padding (`xray/data/packing.py`); `moe` adds a mixture of experts' router
    loss to the training loss (`xray/config/moe.py`); `activation_checkpointing` recomputes each
    decoder layer in the backward (transformers' gradient checkpointing, non-reentrant)."""
    if dtype is not None:
        options = dataclasses.replace(options, dtype=dtype)
    return DeepSpeedEngine(model_dir, parallel, role, optim, seed, zero_stage, device, options,
                           forward_micro_batch_size, lora, max_tokens_per_micro_batch, packing, moe,
                           activation_checkpointing)
