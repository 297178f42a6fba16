"""MegatronEngine: one shard of an actor, critic or reference model, trained with Megatron-core.

The top of `xray.backends.megatron`: `build_engine` checks the layout against the HF config,
initialises Megatron's tensor / pipeline / data-parallel groups inside the default process
group, builds this rank's GPTModel from the HF directory (`model.py`) and wraps it in an engine
that meets `xray.backends.base.TrainEngine`: forward (log-probs and entropy, or values), a train
step through Megatron's pipeline schedule with the shared AdamW (`xray/backends/optim.py`),
export of full HF-named weights (`export.py`), and sharded save / load (`checkpoint.py`). With
`lora` the base weights are frozen and adapters (`lora.py`) train on the parallel linear layers:
the export then yields the merged weights, `export_adapter` the adapter with `peft` names. With
expert parallelism (`ParallelDims.ep`) the peers of an expert-parallel group run micro-batches of
one shape together (`experts.py`).
On CPU every call into Megatron runs under `cpu_compat`.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from xray.backends import cpu_compat
from xray.backends.base import LossFn, OptimConfig, ShardInfo, TrainEngine, WeightBucket, apply_loss, layout_of
from xray.backends.export_digest import ExportCheck
from xray.backends.megatron import checkpoint, experts, grads, reshard
from xray.backends.megatron.attention import attention_mask, packed_params
from xray.backends.megatron.convert import Entry, Kind, to_shard
from xray.backends.megatron.export import export_full, gather_entries
from xray.backends.megatron.imports import import_megatron
from xray.backends.megatron.logprobs import PolicyOutputs, token_logprobs
from xray.backends.megatron.lora import (MergedParameters, attach, checkpoint_header, disabled, full_shape,
                                         local_shape, lora_entries)
from xray.backends.megatron.mixed import Mixed, torch_dtype, wrap
from xray.backends.megatron.model import ATTENTIONS, ROLES, build_and_load
from xray.backends.megatron.spec import ModelSpec, check_layout
from xray.backends.optim import (ABORT, SKIPPED, build_optimizer, build_scheduler, follow_configured_lr, frozen_lr,
                                 skips_update)
from xray.backends.optim import state_bytes as optim_state_bytes
from xray.backends.snapshot import Snapshot, file_key, host_copy
from xray.config.lora import LoraConfig
from xray.config.moe import MoeConfig
from xray.config.parallel import LayoutError, ParallelDims
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.budget import forward_micro_batches, restored
from xray.data.lengths import train_micro_batches
from xray.data.packing import pack_rows

logger = logging.getLogger(__name__)


class EngineUsageError(RuntimeError):
    """An engine call that its role or state does not allow; the message says what to do."""


class MegatronEngine(TrainEngine):
    """One rank's shard; build it with `build_engine`."""

    def __init__(self, model: torch.nn.Module, entries: list[Entry], spec: ModelSpec,
                 parallel: ParallelDims, role: str, optim: OptimConfig, device: torch.device,
                 forward_micro_batch_size: int | None, mixed: Mixed | None = None,
                 lora: LoraConfig | None = None, adapter_entries: list[Entry] = (),
                 max_tokens_per_micro_batch: int | None = None, packing: bool = False, balanced: bool = False):
        self.max_tokens, self.packing = max_tokens_per_micro_batch, packing
        self.balanced = balanced  # the routers add a load-balancing loss: padding is kept out of it
        self.model, self.spec, self.parallel, self.role = model, spec, parallel, role
        self.mixed = mixed  # bf16: Megatron's Float16Module, DDP and optimizer (`mixed.py`)
        self.runner = mixed.runner if mixed is not None else model
        self.lora = lora
        self._adapters = list(adapter_entries)  # this stage's adapter tensors (`lora.lora_entries`)
        self._replicated = {e.megatron_name for e in [*entries, *self._adapters] if e.kind is Kind.REPLICATED}
        self._tp_partial = {e.megatron_name for e in entries if e.tp_partial}  # Qwen3's q/k norms
        self.device = device
        self.forward_micro_batch_size = forward_micro_batch_size
        self.rank = dist.get_rank()
        self.step = 0
        self.optimizer = self.scheduler = None
        if mixed is not None:
            self.optimizer, self.scheduler = mixed.optimizer, mixed.scheduler
        elif role != "reference":
            self.optimizer = build_optimizer(self._trained().values(), optim)
            self.scheduler = build_scheduler(self.optimizer, optim)
        self.optim = optim
        self._info = layout_of(parallel, self.rank)

    def _trained(self) -> dict[str, torch.nn.Parameter]:
        """The parameters that train (all, or with LoRA the adapters and a critic's head)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def _checkpointed(self) -> dict[str, torch.nn.Parameter]:
        """What a checkpoint holds: every parameter, or with LoRA the trained ones (the frozen
        base is rebuilt from the model directory)."""
        return self._trained() if self.lora is not None else dict(self.model.named_parameters())

    # ---- calls into Megatron -------------------------------------------------------------
    def _compat(self):
        return cpu_compat.device_context(str(self.device))

    def _head_outputs(self, output: torch.Tensor, mb: Batch) -> dict[str, torch.Tensor]:
        """Model output of the last stage -> LOGPROBS (+ lazy ENTROPY) or VALUES, each [b, T-1]."""
        if self.role == "critic":
            return {C.VALUES: output[:, :-1, 0].float()}
        logprobs, entropy = token_logprobs(output, mb[C.INPUT_IDS])
        return PolicyOutputs(logprobs, entropy)

    def _run(self, micro: list[Batch], loss_func: Callable, forward_only: bool) -> list[Any]:
        """All micro-batches through Megatron's schedule; the last stage gets loss_func's dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids = mb[C.INPUT_IDS]
            if self.packing:  # one sequence, no padding: `xray/data/packing.py`
                pack = pack_rows(ids, mb[C.ATTENTION_MASK])
                output = model(input_ids=pack.ids, position_ids=pack.positions, attention_mask=None,
                               packed_seq_params=packed_params(pack))
                return pack.unpack(output), partial(loss_func, mb)
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            padding = {"padding_mask": mb[C.ATTENTION_MASK] == 0} if self.balanced else {}
            with experts.replaying(self.model, mb):  # the rollout's routing, where the batch carries it
                output = model(input_ids=ids, position_ids=positions,
                               attention_mask=attention_mask(mb[C.ATTENTION_MASK]), **padding)
            return output, partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[self.runner],
            num_microbatches=len(micro), seq_length=micro[0][C.INPUT_IDS].shape[1],
            micro_batch_size=len(micro[0]), forward_only=forward_only)

    # ---- TrainEngine ------------------------------------------------------------------------
    def shard_info(self) -> ShardInfo:
        return self._info

    def forward(self, batch: Batch, entropy: bool = False, adapters: bool = True) -> dict[str, torch.Tensor] | None:
        batch = batch.select([k for k in (*C.MODEL_INPUTS, C.ROUTED_EXPERTS) if k in batch]).to(self.device)
        if self.max_tokens is not None:
            micro, order = forward_micro_batches(batch, self.max_tokens, packed=self.packing)
        else:
            micro, order = batch.micro_batches(self.forward_micro_batch_size), None
        shapes = [experts.shape_of(mb) for mb in micro]
        if self.parallel.ep > 1:  # the expert-parallel group runs micro-batches of one shape together
            micro = experts.even(micro, self.device, fill=True, one_shape=self.parallel.pp > 1)

        def keep(mb: Batch, output: torch.Tensor):
            outputs = self._head_outputs(output, mb)
            if entropy and self.role != "critic":
                outputs[C.ENTROPY]  # noqa: B018 - computes the entropy
            return output.new_zeros(()), {k: v.detach() for k, v in outputs.items()}

        self.runner.eval()
        off = disabled(self.model) if self.lora is not None and not adapters else nullcontext()
        with self._compat(), torch.no_grad(), off:
            stored = self._run(micro, keep, forward_only=True)
        if not self._info.collects:
            return None
        if self.parallel.ep > 1:
            stored = experts.uneven(stored, shapes)
        if order is not None:
            return {k: v.cpu() for k, v in restored(stored, order, batch[C.INPUT_IDS].shape[1] - 1).items()}
        return {k: torch.cat([s[k] for s in stored]).cpu() for k in stored[0]}

    def train_step(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        if self.optimizer is None:
            raise EngineUsageError(f"the {self.role} engine has no optimizer; train an actor or "
                                   "critic engine, or build this one with role='actor'")
        # A pipeline schedule sends one activation shape: group by length, trim only without one.
        micro = [mb.to(self.device) for mb in train_micro_batches(batch, loss_fn, micro_batch_size,
                                                                   trim=self.parallel.pp == 1,
                                                                   replicas=self.parallel.dp,
                                                                   max_tokens=self.max_tokens,
                                                                   packed=self.packing,
                                                                   agree=self._agree if self.parallel.ep > 1 else None)]
        if self.parallel.ep > 1:
            micro = experts.even(micro, self.device, fill=False, one_shape=self.parallel.pp > 1)

        def loss_func(mb: Batch, output: torch.Tensor):
            loss, metrics = apply_loss(loss_fn, self._head_outputs(output, mb), mb)
            return loss, {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

        self.runner.train()
        if self.mixed is not None:
            self.mixed.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        with self._compat():
            stored = self._run(micro, loss_func, forward_only=False)
            norm = self._finish_grads()
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = self._reduce_metrics(stored)
        aux = experts.router_loss(len(micro), self.parallel.dp, self.device) if self.balanced else None
        if aux is not None:
            metrics["router_aux_loss"] = aux
        skipped = skips_update(metrics.get(SKIPPED), metrics.get(ABORT))  # the same on every rank: reduced over all
        with frozen_lr(self.optimizer, skipped), self._compat():
            stepped = self.mixed.step() if self.mixed is not None else None
            if stepped is None:
                self.optimizer.step()
        norm = stepped if stepped is not None else norm
        self.scheduler.step()
        self.step += 1
        return {**metrics, "grad_norm": norm, "lr": lr, "update_skipped": float(skipped)}

    def _finish_grads(self) -> float | None:
        """Gradients reduced over replicas and tied copies; fp32 also clips here (the norm),
        bf16 leaves clipping to Megatron's optimizer step (None)."""
        if self.mixed is not None:
            self.mixed.finish_grads()
            return None
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        grads.allreduce_tensor_partial([p for n, p in named if n in self._tp_partial])
        grads.allreduce_data_parallel(named)
        grads.allreduce_tied_embedding(self.model)
        return grads.clip_grad_norm(self.model, self.optim.grad_clip, self._replicated)

    def _agree(self, count: int) -> int:
        """The micro-batch count of a token-budget train step: the expert-parallel group's largest."""
        return experts.agree_count(count, self.device)

    def _reduce_metrics(self, stored: list[dict[str, float]]) -> dict[str, float]:
        """Mean over micro-batches (last stage) and replicas, then shared with every stage."""
        from megatron.core import parallel_state as ps

        metrics = [None]
        if ps.is_pipeline_last_stage():
            keys = sorted(stored[0])
            values = torch.tensor([[s[k] for k in keys] for s in stored], dtype=torch.float64).mean(0)
            if self.parallel.dp > 1:
                values = values.to(self.device)
                dist.all_reduce(values, group=ps.get_data_parallel_group())
                values = values.cpu() / self.parallel.dp
            metrics = [dict(zip(keys, values.tolist()))]
        if self.parallel.pp > 1:
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(metrics, src=last, group=ps.get_pipeline_model_parallel_group())
        return metrics[0]

    def export_weights(self, bucket_bytes: int = 64 << 20, replica: int = 0,
                       check: bool = True) -> Iterator[WeightBucket]:
        verdict = ExportCheck() if check else None
        self._export_check = verdict if self.exports(replica) else None
        with torch.no_grad():
            merged = MergedParameters(self.model) if self.lora is not None else None
            yield from export_full(self.model, self.spec, self.parallel, self.role == "critic",
                                   bucket_bytes, replica, merged, verdict)

    def export_adapter(self, replica: int = 0) -> dict[str, torch.Tensor] | None:
        if self.lora is None:
            return super().export_adapter(replica)
        return self._gather_adapter(lambda p: p.detach(), replica)

    def adapter_grads(self, replica: int = 0) -> dict[str, torch.Tensor] | None:
        """The adapters' gradients of the last train step, gathered like `export_adapter`, for
        checks and debugging (fp32: reduced and clipped, as stepped; bf16: Megatron's reduced fp32
        gradient buffer, before clipping). Collective."""
        if self.lora is None:
            raise EngineUsageError(f"the {self.role} engine trains no LoRA adapters; build it with "
                                   "lora=LoraConfig(...) (<role>.lora in the config)")
        return self._gather_adapter(lambda p: p.grad if p.grad is not None else p.main_grad, replica)

    def _gather_adapter(self, value: Callable[[torch.nn.Parameter], torch.Tensor],
                        replica: int) -> dict[str, torch.Tensor] | None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            mine = {e.megatron_name: value(params[e.megatron_name]) for e in self._adapters}
            stages = [lora_entries(self.spec, self.lora, s, self.parallel.pp) for s in range(self.parallel.pp)]
            shape = partial(local_shape, spec=self.spec, lora=self.lora, tp=self.parallel.tp)
            return gather_entries(stages, mine, shape, self.spec, self.parallel, replica)

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the adapters from full tensors with `peft` names (what `export_adapter` returns, or
        a `peft` adapter's state dict); each rank takes its shard. Every rank passes all tensors."""
        if self.lora is None:
            raise EngineUsageError(f"the {self.role} engine has no LoRA adapters; build it with lora=LoraConfig(...)")
        wanted = {e.hf_names[0]: e for s in range(self.parallel.pp)
                  for e in lora_entries(self.spec, self.lora, s, self.parallel.pp)}
        if set(tensors) != set(wanted):
            missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
            raise EngineUsageError(f"the adapter does not match lora={self.lora}: missing {missing[:3]}, "
                                   f"unexpected {extra[:3]}; load an adapter trained with the same "
                                   "rank and target_modules")
        for name, entry in wanted.items():
            if tuple(tensors[name].shape) != full_shape(entry, self.spec, self.lora):
                raise EngineUsageError(f"{name} has shape {tuple(tensors[name].shape)}, this model's adapter "
                                       f"{full_shape(entry, self.spec, self.lora)}; was it trained on this model?")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for entry in self._adapters:
                full = tensors[entry.hf_names[0]]
                shard = to_shard(entry, [full], self.spec, self._info.tp_rank, self.parallel.tp)
                params[entry.megatron_name].copy_(shard)
        if self.mixed is not None and self.optimizer is not None:  # its fp32 main copies follow
            with self._compat():
                self.optimizer.reload_model_params()

    def state_bytes(self) -> dict[str, int]:
        return optim_state_bytes(self.model.parameters(), self.optimizer)

    def close(self) -> None:
        """Megatron's module-level groups (tensor, pipeline, data, expert) are destroyed: the next
        build in this process initialises them over the new default group."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()

    def exports(self, replica: int = 0) -> bool:
        return self.rank == self.parallel.rank_of(0, 0, replica)

    def _header(self) -> dict[str, Any]:
        return checkpoint.header_of(self.spec, self.parallel, self.role,
                                    None if self.lora is None else checkpoint_header(self.lora))

    def save(self, directory: str) -> None:
        state = {"model": {k: v.detach().cpu() for k, v in self._checkpointed().items()},
                 "step": self.step, "rng": checkpoint.rng_state(self.device)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        path = checkpoint.save_shard(directory, self.rank, self._header(), state)
        logger.info("saved step %d to %s", self.step, path)
        dist.barrier()

    def snapshot(self, directory: str) -> Snapshot:
        state = {"model": self._checkpointed(), "step": self.step}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        state = {**host_copy(state), "rng": checkpoint.rng_state(self.device)}  # one block: freed at once
        return Snapshot([(str(checkpoint.shard_path(directory, self.rank)), {"header": self._header(), **state})])

    def as_rank(self, files: dict, directory: str, source: int, rank: int) -> dict:
        """Rank `source`'s file as rank `rank`'s: data-parallel peers hold the same weights and
        AdamW state (their random state aside, which `rank` then takes from `source`)."""
        if self.parallel.ep > 1:
            raise NotImplementedError("with expert parallelism the data-parallel replicas hold different experts; "
                                      "restore every rank from its own file")
        moved = {file_key(checkpoint.shard_path(directory, source)): file_key(checkpoint.shard_path(directory, rank))}
        return {moved.get(k, k): v for k, v in files.items()}

    def restore_ranks(self, saved: ParallelDims) -> list[int]:
        return reshard.needed_ranks(saved)  # the first data-parallel replica's

    def load(self, directory: str, held: dict | None = None, complete: bool = False) -> None:
        """Restore a checkpoint of this model and role, written in this layout (this rank's file
        read from `held` when it holds it) or in another (resharded: `xray/backends/megatron/reshard.py`,
        from `held` when it holds the first replica's files: `reshard.needed_ranks`). `complete`
        is for engines that need every file at once (DeepSpeed); here a file is looked up alone."""
        header = self._header()
        saved = checkpoint.header_in(directory, held)
        if saved is not None and saved != header and {k: saved.get(k) for k in ("spec", "role", "lora")} == \
                {k: header.get(k) for k in ("spec", "role", "lora")}:
            critic = self.role == "critic"
            if self.parallel.ep > 1 or saved["parallel"].get("ep", 1) > 1:
                raise checkpoint.CheckpointMismatchError(
                    f"{directory} was saved with layout {saved['parallel']}, this engine is {header['parallel']}: "
                    "a checkpoint with expert parallelism reloads only into its own layout; resume with that")
            full, first = reshard.read_full(directory, self.spec, ParallelDims(**saved["parallel"]), critic, self.lora,
                                            held)
            state = reshard.shard_state(full, first, self.spec, self.parallel, self.rank, critic,
                                        list(self._checkpointed()), self.lora)
            logger.info("resharding a checkpoint of %s into %s", saved["parallel"], header["parallel"])
        else:
            state = checkpoint.load_shard(directory, self.rank, header, held)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in state["model"].items():
                params[name].copy_(value)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            follow_configured_lr(self.scheduler, self.optim.lr)
        self.step = state["step"]
        checkpoint.set_rng_state(state["rng"], self.device)
        logger.info("loaded step %d from %s", self.step, directory)
        dist.barrier()


def _init_parallel_state(parallel: ParallelDims) -> None:
    import_megatron()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (parallel.tp, parallel.pp, parallel.dp, parallel.ep):
            raise LayoutError(
                f"this process already holds Megatron groups for tp, pp, dp, ep = {have}, not "
                f"{(parallel.tp, parallel.pp, parallel.dp, parallel.ep)}; engines sharing a process must share a "
                "layout")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
                                 expert_model_parallel_size=parallel.ep)
    c = parallel.coords(dist.get_rank())
    got = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
           ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank())
    assert got == (c.tp_rank, c.pp_rank, c.dp_rank, c.dp_rank % parallel.ep), (got, c)


def build_engine(model_dir: str, parallel: ParallelDims, role: str, optim: OptimConfig = OptimConfig(),
                 seed: int = 0, device: str = "cpu", forward_micro_batch_size: int | None = None,
                 attention: str = "sdpa", dtype: str = "float32", lora: LoraConfig | None = None,
                 max_tokens_per_micro_batch: int | None = None, packing: bool = False,
                 moe: MoeConfig = MoeConfig(), activation_checkpointing: bool = False) -> MegatronEngine:
    """Build this rank's engine. torch.distributed's default group must already span exactly
    `parallel.world_size` processes. `role` is "actor", "reference" or "critic";
    `forward_micro_batch_size` bounds the rows per micro-batch of `forward` (None: the whole
    batch at once); `attention` picks the core attention ("sdpa": torch's fused kernel,
    "megatron": Megatron's DotProductAttention); `dtype` "bfloat16" trains bf16 parameters with
    fp32 main weights and fp32 gradient reduction through Megatron's own machinery (`mixed.py`);
    `lora` freezes the base weights and trains LoRA adapters (`lora.py`; a critic's value head
    trains too), seeded by `seed`; `max_tokens_per_micro_batch` cuts forwards and length-grouped
    train steps by that token budget instead of by rows (`xray/data/budget.py`; pp=1); `packing`
    runs each micro-batch's rows as one sequence without padding (`xray/data/packing.py`; pp=1,
    the sdpa attention); `moe`: a mixture of experts' router loss (`xray/config/moe.py`);
    `activation_checkpointing`: Megatron's full recompute, layer by layer, in train steps."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if lora is not None and role == "reference":
        raise EngineUsageError("a reference trains no adapters: build it without lora (the actor's "
                               "forward(batch, adapters=False) is the frozen base, i.e. the reference)")
    if (max_tokens_per_micro_batch is not None or packing) and parallel.pp > 1:
        raise LayoutError(f"max_tokens_per_micro_batch and packing need pp=1, got pp={parallel.pp}: a "
                          "pipeline schedule sends one activation shape; cut by micro_batch_size rows instead")
    if parallel.ep > 1 and (packing or lora is not None):
        raise LayoutError(f"ep={parallel.ep} with {'packing' if packing else 'LoRA'}: expert parallelism runs "
                          "padded micro-batches of full weights; set ep=1, or packing false and lora null")
    if activation_checkpointing and moe.routing_replay:
        raise EngineUsageError("activation_checkpointing with moe.routing_replay: the backward's recompute would "
                               "route anew instead of replaying the rollout's routing; turn one of them off")
    if packing and attention != "sdpa":
        raise EngineUsageError(f"packing runs on the sdpa attention, not {attention!r}: its core attention "
                               "keeps each packed row to itself; build with attention='sdpa'")
    spec = check_layout(model_dir, parallel)
    params_dtype = torch_dtype(dtype)
    if not dist.is_initialized():
        raise EngineUsageError("torch.distributed is not initialised; the Workhorse (or "
                               "tests/dist_harness.run_distributed) must create the default group first")
    if dist.get_world_size() != parallel.world_size:
        raise LayoutError(f"the process group has {dist.get_world_size()} ranks but tp*pp*dp = "
                          f"{parallel.world_size}; make them equal")
    dev = torch.device(device)
    on_cpu = dev.type == "cpu"
    _init_parallel_state(parallel)
    if on_cpu:
        cpu_compat.apply()
        torch.manual_seed(seed)
    else:
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    with cpu_compat.device_context(device):
        recompute = activation_checkpointing and role != "reference"
        model, entries = build_and_load(model_dir, spec, parallel, role, on_cpu, seed, attention, params_dtype, moe,
                                        recompute)
        adapter_entries = [] if lora is None else _add_lora(model, spec, parallel, role, lora, seed)
    if recompute and lora is not None:
        _embedding_needs_grad(model)
    model.to(dev)
    if role == "reference":
        model.requires_grad_(False)
    mixed = None
    if params_dtype != torch.float32:
        with cpu_compat.device_context(device):
            mixed = wrap(model, None if role == "reference" else optim)
    return MegatronEngine(model, entries, spec, parallel, role, optim, dev, forward_micro_batch_size, mixed,
                          lora, adapter_entries, max_tokens_per_micro_batch, packing,
                          moe.balanced and role != "reference")


def _embedding_needs_grad(model: torch.nn.Module) -> None:
    """A recomputed layer passes gradients on only to inputs that need them (Megatron's checkpoint
    is an autograd function): with a frozen embedding (LoRA) its output is marked as needing one,
    or the adapters of the layers would get none."""
    def needs_grad(module, args, output):
        return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output

    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(needs_grad)


def _add_lora(model: torch.nn.Module, spec: ModelSpec, parallel: ParallelDims, role: str, lora: LoraConfig,
              seed: int) -> list[Entry]:
    """Freeze the shard (but a critic's value head) and put adapters on it; their entries."""
    from megatron.core import parallel_state as ps

    model.requires_grad_(False)
    if role == "critic" and ps.is_pipeline_last_stage():
        model.output_layer.weight.requires_grad_(True)
    return attach(model, spec, lora, ps.get_pipeline_model_parallel_rank(), parallel.pp,
                  ps.get_tensor_model_parallel_rank(), parallel.tp, seed)
