"""The DeepSpeed-Inference generation backend: a Hugging Face model under `deepspeed.init_inference`.

Sits under a rollout Workhorse (xray/workhorse), behind the `GenerationEngine` contract of
xray.backends.base; loaded by name through `xray.backends.load_backend("dsinfer")`. Generation is
Hugging Face `generate` on the module DeepSpeed prepared (AutoTP-sharded when tp > 1, no kernel
injection); the log-prob of each sampled token is read from the model's raw logits (before
temperature, top-k, top-p) while it generates, as vLLM's `raw_logprobs` are. Stop strings (`stop`,
on an engine built with `stop_strings`): a row stops generating once its text holds one, and its
response keeps the tokens up to the one that completes the first (`xray.data.stops`), as vLLM's do.

Tensor parallelism: the processes of one replica are consecutive ranks of the default group
(Megatron order, tp fastest); every rank of the group builds its engine at the same time.

CPU note (why tp=2 died with SIGSEGV): DeepSpeed's `inference_all_reduce` uses its shared-memory
all-reduce kernel whenever that op is built, but the kernel maps its shared workspace only when
the environment variable LOCAL_SIZE equals the world size (the `deepspeed` launcher sets it;
torchrun, Ray and our test harness do not). Without it the kernel dereferences a null workspace.
The kernel also ignores the process group (it reduces over the whole world). `_guard_cpu_allreduce`
therefore keeps the kernel only where it is correct, and otherwise sends DeepSpeed to
`torch.distributed.all_reduce` on the tensor-parallel group.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xray.backends.base import GenerationEngine, WeightBucket
from xray.backends.expert_names import ExpertPart, expert_part, expert_view, fused_parts
from xray.backends.held import HeldCheck
from xray.backends.hf_routing import RoutingRecorder, routers
from xray.backends.sampling import ROUTED_EXPERTS_ROWS, SamplingSpec, call_seed, rollout_batch
from xray.data.batch import Batch
from xray.data.stops import stop_string_end, text_decoder

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DsInferError(RuntimeError):
    """The DeepSpeed-Inference engine was asked for something it cannot do; the text says the fix."""


@dataclass(frozen=True)
class DsInferConfig:
    """How to build one DeepSpeed-Inference shard."""

    model_dir: str
    """Local Hugging Face model directory."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    seed: int = 0
    """Base of the per-call seed when a generate call gives none."""
    max_model_len: int = 1024
    """Longest prompt + response in tokens; longer requests are refused."""
    tp: int = 1
    """Tensor-parallel size (AutoTP); the default process group must hold a multiple of it."""
    device: str = "cpu"
    """cpu or cuda."""
    generate_batch: int = 32
    """Rows per Hugging Face `generate` call (prompts x n are cut into chunks of this size)."""
    report_routing: bool = False
    """A mixture of experts: also return the experts each token was routed to (`ROUTED_EXPERTS_ROWS`,
    `xray/backends/hf_routing.py`), for the training forwards to replay."""
    stop_strings: bool = False
    """Load the model directory's tokenizer, so that generate calls may give `stop` strings."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for `deepspeed.init_inference`."""


def build_engine(model_dir: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 1024, tp: int = 1, device: str = "cpu",
                 generate_batch: int = 32, report_routing: bool = False, stop_strings: bool = False,
                 **init_kwargs: Any) -> "DsInferEngine":
    """Build this process's DeepSpeed-Inference shard of `model_dir` (collective when tp > 1)."""
    config = DsInferConfig(model_dir=str(model_dir), dtype=dtype, seed=seed,
                           max_model_len=max_model_len, tp=tp, device=device,
                           generate_batch=generate_batch, report_routing=report_routing,
                           stop_strings=stop_strings, init_kwargs=dict(init_kwargs))
    return DsInferEngine(config)


class TensorParallelUnit:
    """The `mpu` DeepSpeed asks for: this replica's tensor-parallel group (consecutive ranks)."""

    def __init__(self, tp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp:
            raise DsInferError(f"tp={tp} does not divide the {world} processes of the default group; "
                               "make the rollout group's size a multiple of tp")
        self.tp, self.rank = tp, rank
        self.group = None
        for first in range(0, world, tp):  # every rank creates every group (new_group is collective)
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                self.group = group

    def get_model_parallel_group(self):
        return self.group

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp


def _guard_cpu_allreduce(tp: int) -> None:
    """Use DeepSpeed's shared-memory all-reduce only where it works (see the module docstring)."""
    import deepspeed.comm.comm as ds_comm

    backend = ds_comm.cdb
    world = dist.get_world_size()
    shm_ready = os.environ.get("LOCAL_SIZE") == str(world)
    if backend is not None and not (shm_ready and tp == world):
        backend.shm_vector_kernel_level = 0  # DeepSpeed then falls back to torch.distributed
        logger.info("DeepSpeed shm all-reduce off (LOCAL_SIZE=%s, world=%d, tp=%d): using gloo",
                    os.environ.get("LOCAL_SIZE"), world, tp)


class _ChosenTokenLogprobs:
    """A logits processor that records log p(chosen token) from the raw logits of each step.

    Hugging Face calls it once per step with the sequence so far; the token chosen at step t is
    the last input id at step t+1, so only one step's log-softmax [B, V] is kept at a time."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """[B, R] log-probs of the generated tokens [B, R]."""
        if self.previous is not None and len(self.steps) < generated.shape[1]:
            self.steps.append(self.previous.gather(-1, generated[:, -1:]).squeeze(-1))
        return torch.stack(self.steps, dim=1) if self.steps else generated.new_zeros(generated.shape, dtype=torch.float)


class _StopStrings:
    """A Hugging Face stopping criterion: a row is done once its response's text holds one of the
    stop strings (where exactly it ends is `stop_string_end`'s, afterwards)."""

    def __init__(self, decode, stops: tuple[str, ...], prompt_width: int):
        self.decode, self.stops, self.width = decode, stops, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = (self.decode(row) for row in input_ids[:, self.width:].tolist())
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


class DsInferEngine(GenerationEngine):
    """One shard of a DeepSpeed-Inference rollout replica."""

    def __init__(self, config: DsInferConfig):
        import deepspeed
        from transformers import AutoModelForCausalLM

        if config.dtype not in DTYPES:
            raise DsInferError(f"dtype={config.dtype!r}; use one of {sorted(DTYPES)}")
        self.config = config
        model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=DTYPES[config.dtype])
        model.eval()
        full_shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
        tp_config: dict[str, Any] = {"tp_size": config.tp}
        if config.tp > 1:
            if not dist.is_initialized():
                raise DsInferError("tp > 1 needs torch.distributed initialised over the rollout "
                                   "processes (the Workhorse does it; tests use tests/dist_harness)")
            deepspeed.init_distributed(dist_backend="gloo" if config.device == "cpu" else "nccl")
            if config.device == "cpu":
                _guard_cpu_allreduce(config.tp)
            mpu = TensorParallelUnit(config.tp)
            # DeepSpeed reads the group from `mpu`, but its AutoTP slicing reads `tp_group`:
            # without it the layers are swapped yet left whole and never all-reduced.
            tp_config.update(mpu=mpu, tp_group=mpu.group)
        kwargs = dict(tensor_parallel=tp_config, dtype=DTYPES[config.dtype],
                      replace_with_kernel_inject=False)
        kwargs.update(config.init_kwargs)
        self.engine = deepspeed.init_inference(model, **kwargs)
        self.module = self.engine.module
        if config.report_routing and not routers(self.module):
            raise DsInferError(f"report_routing: {config.model_dir} has no mixture-of-experts routers to report; "
                               "build without it (moe.routing_replay is for mixtures of experts)")
        self.params = dict(self.module.named_parameters(remove_duplicate=False))
        self.slices = self._shard_slices(full_shapes, tp_config.get("mpu"))
        self.held = HeldCheck()
        self.holds: list[str] = []  # the tensors written since `held_tensors` was last asked
        self._expert_parts: dict[str, set[ExpertPart]] = {}  # fused experts written one expert at a time
        gen = self.module.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.module.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = self.module.config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.decode = text_decoder(_tokenizer(config.model_dir)) if config.stop_strings else None
        self._calls = 0
        logger.info("DeepSpeed-Inference engine ready: %s dtype=%s tp=%d", config.model_dir,
                    config.dtype, config.tp)

    def _shard_slices(self, full_shapes: dict[str, tuple], mpu: TensorParallelUnit | None
                      ) -> dict[str, tuple[int, int, int]]:
        """name -> (dim, start, length) of this rank's shard inside the full tensor (AutoTP
        splits one dimension into contiguous pieces in rank order); also sets `tp_rank` and
        `shard_sizes` (name -> (dim, every rank's length), what the held check cuts by)."""
        local = {}
        for name, param in self.params.items():
            full = full_shapes.get(name, tuple(param.shape))
            dims = [d for d, (a, b) in enumerate(zip(full, param.shape)) if a != b]
            if len(dims) > 1 or len(full) != param.dim():
                raise DsInferError(f"{name}: shard {tuple(param.shape)} of {full} is not a 1-d split")
            if dims:
                local[name] = (dims[0], param.shape[dims[0]])
        self.tp_rank, self.shard_sizes = 0, {}
        if mpu is None:
            return {}
        everyone: list[dict] = [None] * mpu.tp  # type: ignore[list-item]
        dist.all_gather_object(everyone, local, group=mpu.group)
        me = self.tp_rank = mpu.get_model_parallel_rank()
        self.shard_sizes = {name: (dim, [everyone[r][name][1] for r in range(mpu.tp)])
                            for name, (dim, _) in local.items()}
        return {name: (dim, sum(everyone[r][name][1] for r in range(me)), size)
                for name, (dim, size) in local.items()}

    def _check_prompts(self, prompts: list[list[int]], new_tokens: int) -> None:
        for i, p in enumerate(prompts):
            if not p:
                raise DsInferError(f"prompt {i} is empty; give at least one token id")
            if len(p) + new_tokens > self.config.max_model_len:
                raise DsInferError(f"prompt {i} ({len(p)} tokens) + max_new_tokens ({new_tokens}) "
                                   f"exceeds max_model_len={self.config.max_model_len}; shorten it "
                                   "or build the engine with a larger max_model_len")

    def _generate_kwargs(self, spec: SamplingSpec, width: int) -> dict[str, Any]:
        from transformers import StoppingCriteriaList

        kwargs: dict[str, Any] = dict(max_new_tokens=spec.max_new_tokens, pad_token_id=self.pad_id,
                                      eos_token_id=self.eos_ids + list(spec.stop_token_ids),
                                      return_dict_in_generate=True, use_cache=True)
        if spec.stop:
            if self.decode is None:
                raise DsInferError(f"stop={list(spec.stop)}: stop strings need the engine's tokenizer; build the "
                                   "engine with stop_strings=True (a run does when rollout.stop is set)")
            kwargs["stopping_criteria"] = StoppingCriteriaList([_StopStrings(self.decode, spec.stop, width)])
        if spec.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=spec.temperature, top_p=spec.top_p,
                          top_k=spec.top_k_or_none or 0)
        return kwargs

    @torch.no_grad()
    def _generate_chunk(self, rows: list[list[int]], spec: SamplingSpec, seed: int
                        ) -> tuple[list[list[int]], list[list[float]], list[str], list[torch.Tensor]]:
        from transformers import LogitsProcessorList

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding: every prompt ends at the same column
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        device = self.config.device if self.config.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
        recorder = _ChosenTokenLogprobs()
        routing = RoutingRecorder(self.module) if self.config.report_routing else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[] if self.config.device == "cpu" else None), routing:
            torch.manual_seed(seed)
            out = self.module.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       logits_processor=LogitsProcessorList([recorder]),
                                       **self._generate_kwargs(spec, width))
        generated = out.sequences[:, width:].cpu()
        logprobs = recorder.finish(out.sequences[:, width:]).cpu()
        stops = set(self.eos_ids) | set(spec.stop_token_ids)
        responses, lps, reasons = [], [], []
        for row, lp in zip(generated.tolist(), logprobs.tolist()):
            end = next((t + 1 for t, tok in enumerate(row) if tok in stops), None)
            if spec.stop:  # a stop string completed before any stop token: the response ends there
                end = stop_string_end(self.decode, row[:end], spec.stop) or end
            responses.append(row[:end] if end else row)
            lps.append(lp[:end] if end else lp)
            reasons.append("stop" if end else "length")
        routed = (routing.rows(len(rows), width, [len(r) for r in rows], [len(r) for r in responses])
                  if self.config.report_routing else [])
        return responses, lps, reasons, routed

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> Batch:
        spec = SamplingSpec.from_dict(sampling)
        self._check_prompts(prompts, spec.max_new_tokens)
        seed = call_seed(spec, self.config.seed, self._calls)
        self._calls += 1
        rows = [list(map(int, p)) for p in prompts for _ in range(spec.n)]
        responses, logprobs, reasons, routed = [], [], [], []
        step = self.config.generate_batch
        for c, start in enumerate(range(0, len(rows), step)):
            r, lp, why, rt = self._generate_chunk(rows[start:start + step], spec, seed + c)
            responses += r
            logprobs += lp
            reasons += why
            routed += rt
        out = rollout_batch(prompts, spec.n, responses, logprobs, reasons)
        if self.config.report_routing:
            out.lists[ROUTED_EXPERTS_ROWS] = routed
        return out

    def _target(self, name: str) -> torch.Tensor | None:
        """Where `name` is written: its parameter, or for one expert's tensor of a layer whose
        experts the module holds fused (transformers 5, as Megatron exports them one by one) its
        view of the fused parameter."""
        part = expert_part(name)
        if name in self.params or part is None or part.fused not in self.params:
            return self.params.get(name)
        if part.fused in self.slices:
            raise DsInferError(f"{name}: the experts are split over tensor-parallel ranks here; send them fused")
        self._expert_parts.setdefault(part.fused, set()).add(part)
        return expert_view(self.params[part.fused], part)

    @torch.no_grad()
    def load_weights(self, bucket: WeightBucket, check: bool = True) -> None:
        """Copy full Hugging Face tensors into this shard's parameters, in place."""
        for name, tensor in bucket:
            param = self._target(name)
            if param is None:
                raise DsInferError(f"no parameter {name!r} in the model; names look like "
                                   f"{list(self.params)[:3]} (Hugging Face names of the full model)")
            if name in self.slices:
                dim, start, length = self.slices[name]
                tensor = tensor.narrow(dim, start, length)
            if tuple(tensor.shape) != tuple(param.shape):
                raise DsInferError(f"{name}: got shape {tuple(tensor.shape)}, the shard holds "
                                   f"{tuple(param.shape)}; send the full (unsharded) tensor")
            param.copy_(tensor.to(param.device))
            self.holds.append(name)
        if check:
            self._check_held(bucket)

    def _check_held(self, bucket: WeightBucket) -> None:
        """Read back what the module computes with, by module path (the attribute its forward
        reads, not the parameter table the load wrote through), and compare it bit for bit with
        this rank's piece of each full tensor sent, cut anew from every rank's shard sizes
        (`shard_sizes`), not with the slice map the load used."""
        for name, tensor in bucket:
            part = expert_part(name) if name not in self.params else None
            owner, _, attr = (part.fused if part else name).rpartition(".")
            held = getattr(self.module.get_submodule(owner), attr, None)
            if part is not None and held is not None:
                held = expert_view(held, part)
            if name in self.shard_sizes:
                dim, sizes = self.shard_sizes[name]
                tensor = tensor.split(sizes, dim)[self.tp_rank]
            if not self.held.compare(name, held, tensor):
                self.held.skip([name])

    def weight_names(self) -> dict | None:
        """A full sync writes every parameter of the model once (tied ones under their first
        name) and may also send a tied parameter's other names; a layer's fused experts may come
        one tensor per expert (`aliases`; `not_reloaded` names a fused one left partly written)."""
        fused = [n for n in self.params if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
        aliases = {part.name: [n] for n in fused for part in fused_parts(n, self.params[n].shape[0])}
        return {"needs": sorted(dict(self.module.named_parameters())), "takes": sorted(self.params),
                "aliases": aliases}

    def not_reloaded(self) -> list[str]:
        """The fused experts written one expert at a time since the last call that some part of
        was not written."""
        parts, self._expert_parts = self._expert_parts, {}
        return sorted(n for n, got in parts.items() if got != set(fused_parts(n, self.params[n].shape[0])))

    def held_check(self) -> dict:
        return self.held.take()

    def held_tensors(self) -> list[str]:
        """The Hugging Face names the loads since the last call wrote (each checked by that name)."""
        holds, self.holds = self.holds, []
        return holds

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """log p of each sequence's tokens after its prompt, from one forward pass."""
        if len(sequences) != len(prompt_lens):
            raise DsInferError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        result: list[list[float]] = []
        step = self.config.generate_batch
        for start in range(0, len(sequences), step):
            seqs, lens = sequences[start:start + step], prompt_lens[start:start + step]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):  # right padding: positions start at 0 in every row
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            device = next(iter(self.params.values())).device
            logits = self.module(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            logp = logp.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1).cpu()
            for i, (s, plen) in enumerate(zip(seqs, lens)):
                if not 1 <= plen <= len(s):
                    raise DsInferError(f"prompt length {plen} is outside 1..{len(s)}")
                result.append(logp[i, plen - 1:len(s) - 1].tolist())
        return result


def _tokenizer(model_dir: str):
    """The model directory's tokenizer (stop strings are matched on the response's text)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise DsInferError(f"stop_strings=True: no usable tokenizer in {model_dir} ({str(exc).splitlines()[0]}); "
                           "save it there (tokenizer.save_pretrained(dir)) or give no rollout.stop") from None
