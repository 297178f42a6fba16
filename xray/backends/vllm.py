"""The vLLM generation backend: one in-process `vllm.LLM` per rollout replica.

Sits under a rollout Workhorse (xray/workhorse), behind the `GenerationEngine` contract of
xray.backends.base; loaded by name through `xray.backends.load_backend("vllm")`. The engine runs
in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weights can be swapped in place
through vLLM's own `reload_weights` and log-probs come straight from its sampler.

Log-probs are vLLM's `raw_logprobs` (its default `logprobs_mode`): the log-softmax of the model's
logits before temperature, top-k or top-p, which is what the actor recomputes, so the two can be
compared token by token.

On a GPU shared with training roles the engine can sleep (`sleep_mode`, vLLM's sleep mode):
`sleep()` frees its GPU memory (weights to host memory, KV cache dropped) while the training roles
train, `wake_up()` takes it back before the next generation or weight load. vLLM's CPU build does
not support sleep mode, so on CPU it stays off and `sleep()` does nothing.

A quantized engine (`quantization="fp8"`, `rollout.quantization`) is built with vLLM's online fp8
scheme for the device (the registry's, `xray/config/engines.py`): vLLM quantizes each linear layer as it loads
it, and again at every in-place reload, so after a sync it holds the quantized form of the new
weights; `_check_held` compares those codes and scales with our own quantization of the tensors
sent.

This module's name equals the library's: `import vllm` below is an absolute import and always
means the library (this file is `xray.backends.vllm`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from xray.backends.base import GenerationEngine, WeightBucket
from xray.backends.held import HeldCheck
from xray.backends.sampling import SamplingSpec, call_seed, rollout_batch
from xray.backends.vllm_adapter import AdapterSlot
from xray.backends.vllm_adapter import engine_kwargs as adapter_engine_kwargs
from xray.backends import vllm_moe
from xray.backends.vllm_held import ReloadLedger, check_model, fused_layer_of, held_units
from xray.backends.expert_names import moe_block_of
from xray.backends.vllm_moe import Routing
from xray.backends.vllm_process import caller_state_kept, one_collection
from xray.backends.vllm_tied import check as check_heads
from xray.backends.vllm_tied import refresh as refresh_heads
from xray.backends.vllm_tied import tied_heads, written
from xray.config.engines import engine as engine_row
from xray.config.lora import LoraConfig
from xray.data.batch import Batch

logger = logging.getLogger(__name__)

class VllmEngineError(RuntimeError):
    """The vLLM engine was asked for something it cannot do; the text says the fix."""


@dataclass(frozen=True)
class VllmEngineConfig:
    """How to build one in-process vLLM engine."""

    model_dir: str
    """Local Hugging Face model directory (config.json + safetensors)."""
    dtype: str = "float32"
    """Weights and activations dtype: float32, bfloat16 or float16."""
    seed: int = 0
    """Engine seed; also the base of the per-call seed when a call gives none."""
    lora: Optional[LoraConfig] = None
    """The actor's LoRA settings: the engine serves its adapter (`xray/backends/vllm_adapter.py`),
    synced alone, on the model directory's base weights."""
    max_model_len: int = 1024
    """Longest prompt + response in tokens."""
    tp: int = 1
    """Tensor-parallel size. With tp > 1 every rank of the default torch.distributed group (whose
    size must equal tp) builds its engine and makes the same calls: vLLM's `external_launcher`."""
    device: str = "cpu"
    """cpu or cuda; on cpu the KV cache size comes from `kv_cache_gib`."""
    kv_cache_gib: int = 1
    """KV cache size on CPU in whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.9
    """On cuda, the share of the GPU's memory the engine takes (vLLM's own setting)."""
    sleep_mode: bool = False
    """Build with vLLM's sleep mode (cuda only), so that `sleep()` frees the engine's GPU memory."""
    quantization: str = "none"
    """`none`, or `fp8`: quantized online by vLLM's scheme for the device (`scheme`)."""
    stop_strings: bool = False
    """Load the model directory's tokenizer into vLLM, so that generate calls may give `stop`
    strings (vLLM detokenizes only those calls); without it vLLM never loads the tokenizer."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for `vllm.LLM` (they override the defaults set here)."""

    @property
    def scheme(self) -> str | None:
        """vLLM's `quantization=` argument (None: unquantized)."""
        return engine_row("vllm").scheme(self.quantization, self.device)

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs = dict(model=self.model_dir, dtype=self.dtype, seed=self.seed,
                      max_model_len=self.max_model_len, tensor_parallel_size=self.tp,
                      enforce_eager=self.device == "cpu", skip_tokenizer_init=not self.stop_strings,
                      logprobs_mode="raw_logprobs", use_tqdm_on_load=False)  # no loading bar per replica
        if self.device == "cpu":
            # vLLM CPU 0.32 fails a seeded request whose prefill is chunked (`CPU Generator does not
            # use offset`: it rewinds the request's generator, which a CPU generator cannot): whole
            # prefills only, with a token budget of at least one full-length sequence
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, self.max_model_len))
        if self.tp > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.lora is not None:
            kwargs.update(adapter_engine_kwargs(self.lora))
        if self.device == "cuda":
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.scheme is not None:
            kwargs["quantization"] = self.scheme
        kwargs.update(self.engine_kwargs)
        return kwargs


def _prepare_environment(config: VllmEngineConfig) -> None:
    """Environment vLLM reads at start-up: in-process engine core, CPU KV cache size."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config.device == "cpu":
        if int(config.kv_cache_gib) != config.kv_cache_gib or config.kv_cache_gib < 1:
            raise VllmEngineError(f"kv_cache_gib={config.kv_cache_gib}: vLLM's CPU KV cache is sized "
                                  "in whole GiB; give an integer >= 1")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.kv_cache_gib))
    elif config.device != "cuda":
        raise VllmEngineError(f"device={config.device!r} is not supported; use 'cpu' or 'cuda'")
    if config.sleep_mode and config.device != "cuda":
        raise VllmEngineError("sleep_mode=True: vLLM's sleep mode is unsupported on CPU; build the engine "
                              "without it (rollout.sleep: auto or false)")
    if config.stop_strings and not any(Path(config.model_dir, f).is_file()
                                       for f in ("tokenizer.json", "tokenizer_config.json")):
        raise VllmEngineError(f"stop_strings=True: {config.model_dir} has no tokenizer to read stop strings with; "
                              "save it there (tokenizer.save_pretrained(dir)) or give no rollout.stop")
    if config.quantization != "none":
        try:
            config.scheme
        except ValueError as exc:
            raise VllmEngineError(str(exc)) from None
        if config.dtype not in engine_row("vllm").quant_dtypes:
            raise VllmEngineError(f"quantization={config.quantization} with dtype={config.dtype}: vLLM quantizes "
                                  "online from bf16 or fp16 weights only; build the engine with dtype='bfloat16' "
                                  "(rollout.dtype: bfloat16)")
    if config.tp > 1 and config.device == "cpu":
        _replica_shm_names()
    if config.tp > 1:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world != config.tp or "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
            raise VllmEngineError(
                f"tp={config.tp} runs vLLM in-process on every rank (external_launcher): initialise "
                f"torch.distributed over exactly {config.tp} processes (now {world}) with RANK and "
                "LOCAL_RANK set, one group per rollout replica")


def _replica_shm_names() -> None:
    """vLLM on CPU all-reduces a tensor-parallel group through a shared-memory segment named after
    the rendezvous, which under the external launcher is `env://` for every replica: the second tp
    replica on a host then fails (`create shm in SHMManager failed. errno: 17`). The segment's name
    gains this replica's own MASTER_PORT (`RolloutWorkhorse.replica_world` gives each its own), the
    same on all of its ranks. Installed once per process, before the engine starts."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    original = shm.make_group_name
    if getattr(original, "xray_replica", False):
        return

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{os.environ.get('MASTER_PORT', '')}"

    make_group_name.xray_replica = True
    shm.make_group_name = staticmethod(make_group_name)


def build_engine(model_dir: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 1024, tp: int = 1, device: str = "cpu",
                 kv_cache_gib: int = 1, gpu_memory_utilization: float = 0.9, sleep_mode: bool = False,
                 quantization: str = "none", lora: LoraConfig | None = None, stop_strings: bool = False,
                 **engine_kwargs: Any) -> "VllmEngine":
    """Start an in-process vLLM engine on `model_dir` (a script calling this needs the
    `if __name__ == "__main__":` guard)."""
    config = VllmEngineConfig(model_dir=str(model_dir), dtype=dtype, seed=seed,
                              max_model_len=max_model_len, tp=tp, device=device,
                              kv_cache_gib=kv_cache_gib, gpu_memory_utilization=gpu_memory_utilization,
                              sleep_mode=sleep_mode, quantization=quantization, lora=lora,
                              stop_strings=stop_strings, engine_kwargs=dict(engine_kwargs))
    return VllmEngine(config)


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """The tensor names of the safetensors checkpoint in `model_dir`."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise VllmEngineError(f"no *.safetensors in {model_dir}; save the model with "
                              "`save_pretrained(dir, safe_serialization=True)`")
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return names


class FusedLayerStager:
    """Holds back the parts of a fused layer until the whole layer has arrived.

    Weight buckets are cut by size, so q/k/v (or gate/up) of one layer may arrive in two buckets;
    `add` returns the tensors that are ready to reload now, in arrival order. An MoE block (router,
    experts, shared expert) is one layer, whole when every expert's projections have arrived,
    fused or one by one (`Routing.units`). What it holds back it copies: a bucket's memory may be
    reused once its load returns (`xray/transport/shm.py`).
    """

    def __init__(self, names: list[str], routing: Routing | None = None):
        self.routing = routing
        self.members: dict[str, set[str]] = {}
        for name in names:
            self.members.setdefault(fused_layer_of(name), set()).update(self._units(name))
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def _units(self, name: str) -> set[str]:
        moe = self.routing is not None and moe_block_of(name) is not None
        return self.routing.units(name) if moe else {name}

    def add(self, bucket: WeightBucket) -> WeightBucket:
        ready: WeightBucket = []
        for name, tensor in bucket:
            layer = fused_layer_of(name)
            expected = self.members.get(layer)
            if expected is None or len(expected) == 1:
                ready.append((name, tensor))
                continue
            parts = self.pending.setdefault(layer, {})
            parts[name] = tensor
            if expected <= set().union(*map(self._units, parts)):
                ready.extend(self.pending.pop(layer).items())
        arrived = {name for name, _ in bucket}
        for parts in self.pending.values():
            for name in arrived & parts.keys():
                parts[name] = parts[name].clone()
        return ready

    def waiting(self) -> list[str]:
        """Names received whose fused layer is still incomplete."""
        return sorted(n for parts in self.pending.values() for n in parts)


class VllmEngine(GenerationEngine):
    """One rollout replica backed by an in-process `vllm.LLM`."""

    def __init__(self, config: VllmEngineConfig):
        _prepare_environment(config)
        import vllm  # the library (absolute import), imported only when an engine is built

        self.config = config
        self._vllm = vllm
        with caller_state_kept(), one_collection(config.device):
            self.llm = vllm.LLM(**config.llm_kwargs())
        self.names = sorted(checkpoint_names(config.model_dir))
        self.routing = Routing.of(config.model_dir)
        """How the model routes tokens to experts (None: a dense model)."""
        self.stager = FusedLayerStager(self.names, self.routing)
        names = set(self.names)
        self.heads = self.llm.apply_model(lambda model: tied_heads(model, names))[0]
        """Tied output layers and their source layers (`xray/backends/vllm_tied.py`)."""
        self.held = HeldCheck()
        self.holds: list[str] = []  # the engine tensors written since `held_tensors` was last asked
        self.ledger = ReloadLedger()
        self.adapter = AdapterSlot(config.lora, config.model_dir) if config.lora is not None else None
        self._calls = 0
        self.asleep = False
        logger.info("vLLM engine ready: %s dtype=%s tp=%d device=%s quantization=%s", config.model_dir,
                    config.dtype, config.tp, config.device, config.scheme or "none")

    def _prompts(self, prompts: list[list[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        limit = self.config.max_model_len
        for i, p in enumerate(prompts):
            if not p:
                raise VllmEngineError(f"prompt {i} is empty; give at least one token id")
            if len(p) >= limit:
                raise VllmEngineError(f"prompt {i} has {len(p)} tokens, max_model_len is {limit}; "
                                      "shorten the prompt or build the engine with a larger max_model_len")
        return [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]

    def _sampling_params(self, spec: SamplingSpec, seed: int) -> Any:
        """vLLM's parameters for `spec`. Stop strings: the response keeps the token that completes
        one, and the string (`include_stop_str_in_output`), as `xray.data.stops` states for both engines."""
        if spec.stop and not self.config.stop_strings:
            raise VllmEngineError(f"stop={list(spec.stop)}: stop strings need the engine's tokenizer; build the "
                                  "engine with stop_strings=True (a run does when rollout.stop is set)")
        return self._vllm.SamplingParams(
            n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k_or_none or 0,
            max_tokens=spec.max_new_tokens, stop_token_ids=list(spec.stop_token_ids), seed=seed,
            logprobs=0, detokenize=bool(spec.stop), stop=list(spec.stop) or None, include_stop_str_in_output=True)

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> Batch:
        self._check_awake("generate")
        spec = SamplingSpec.from_dict(sampling)
        base_seed = call_seed(spec, self.config.seed, self._calls)
        self._calls += 1
        # One seed per prompt; vLLM gives sample j of a prompt seed + j, so space them by n.
        params = [self._sampling_params(spec, base_seed + i * spec.n) for i in range(len(prompts))]
        outputs = self.llm.generate(self._prompts(prompts), params, use_tqdm=False, lora_request=self._lora())
        responses, logprobs, reasons = [], [], []
        for request in outputs:
            for completion in sorted(request.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                responses.append(ids)
                logprobs.append([float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs)])
                reasons.append("length" if completion.finish_reason == "length" else "stop")
        return rollout_batch(prompts, spec.n, responses, logprobs, reasons)

    def load_weights(self, bucket: WeightBucket, check: bool = True) -> None:
        """Reload these Hugging Face tensors in place (vLLM's layerwise `reload_weights`).

        The parts of a fused layer (q/k/v, gate/up) are held back until all have arrived, so
        buckets may cut anywhere. The prefix cache is dropped: it holds keys and values computed
        with the old weights."""
        bucket = self.adapter.add(list(bucket)) if self.adapter is not None else bucket
        ready = self.stager.add(list(bucket))
        if not ready:
            return
        heads = self.reload(ready)
        self.holds += held_units(ready, self.routing is not None) + [f"{head}.weight" for head in heads]
        if check:
            self._check_held(ready, heads)
        logger.debug("reloaded %d tensors; %d waiting for their fused layer", len(ready),
                     len(self.stager.waiting()))

    def reload(self, tensors: WeightBucket) -> list[str]:
        """vLLM's own in-place reload of whole Hugging Face tensors (fused layers complete), the tied
        heads of the layers it wrote processed again, then the prefix cache dropped: the floor of
        every weight sync into this engine. Returns those heads."""
        with self.ledger.reloading():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        heads = written(self.heads, [name for name, _ in tensors])
        if heads:  # their packed weights still hold the old values
            self.llm.apply_model(lambda model: refresh_heads(model, heads))
        blocks = {block for name, _ in tensors if (block := moe_block_of(name)) is not None}
        if blocks and self.routing is not None:  # the CPU experts' kernel packs its weights again
            self.llm.apply_model(lambda model: vllm_moe.reprepare(model, blocks))
        if self.adapter is not None:  # vLLM dropped the adapter: it comes back from memory
            self.adapter.restore(self.llm)
        self.llm.reset_prefix_cache()
        return heads

    def _check_held(self, ready: WeightBucket, heads: list[str] = ()) -> None:
        """Check what the engine holds of the tensors just reloaded (`xray/backends/vllm_held.py`:
        bit for bit where readable, else its own layers' products; a quantized layer's fp8 codes
        and scales against our quantization of them)."""
        dtype, scheme = getattr(torch, self.config.dtype), self.config.scheme
        moe = (self.routing, self.llm.llm_engine.vllm_config) if self.routing is not None else None
        self.held.merge(self.llm.apply_model(lambda model: check_model(model, ready, dtype, scheme, moe))[0])
        if heads:
            tied = {head: self.heads[head] for head in heads}
            sent = dict(ready)
            self.held.merge(self.llm.apply_model(lambda model: check_heads(model, tied, sent, dtype))[0])

    def held_check(self) -> dict:
        return self.held.take()

    def held_tensors(self) -> list[str]:
        """The layers' tensors the reloads since the last call wrote (`vllm_held.held_units`) and
        the adapter tensors applied."""
        holds, self.holds = self.holds, []
        return holds

    def finish_load(self) -> None:
        """The end of a sync: the adapter received (if any) is loaded now, and checked."""
        if self.adapter is not None and self.adapter.apply(self.llm, getattr(torch, self.config.dtype), self.held):
            self.holds += sorted(self.adapter.current)

    def takes_adapter(self) -> bool:
        """Whether the engine serves the actor's LoRA adapter (a sync then sends it alone)."""
        return self.adapter is not None

    def _lora(self):
        return self.adapter.request if self.adapter is not None else None

    def weight_names(self) -> dict | None:
        """A full sync writes every tensor of the model directory's checkpoint (None when the
        engine takes the actor's adapter alone); an MoE block's experts may come fused (`aliases`)."""
        if self.adapter is not None:
            return None
        aliases = vllm_moe.fused_aliases(self.names) if self.routing is not None else {}
        return {"needs": self.names, "takes": self.names, "aliases": aliases}

    def pending_weights(self) -> list[str]:
        """Names loaded but not yet applied because their fused layer is incomplete."""
        return self.stager.waiting()

    def drop_pending(self) -> list[str]:
        waiting = self.stager.waiting()
        self.stager.pending.clear()
        return waiting

    def not_reloaded(self) -> list[str]:
        """The engine's parameters no reload since the last call wrote (vLLM's own account)."""
        return self.ledger.take()

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """vLLM's log-probs of each sequence's tokens after its prompt (its prompt log-probs)."""
        self._check_awake("score sequences")
        if len(sequences) != len(prompt_lens):
            raise VllmEngineError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
            if not 1 <= plen <= len(seq):
                raise VllmEngineError(f"prompt_lens[{i}]={plen} is outside 1..{len(seq)}; a prompt "
                                      "needs at least one token and cannot exceed its sequence")
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                           detokenize=False)
        prompts = self._prompts(sequences)
        if self.adapter is None:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        else:  # one prompt per call: batched prompt log-probs break on a LoRA engine (FACTS.md)
            outputs = [out for p in prompts
                       for out in self.llm.generate([p], params, use_tqdm=False, lora_request=self._lora())]
        result = []
        for seq, plen, request in zip(sequences, prompt_lens, outputs):
            steps = request.prompt_logprobs
            result.append([float(steps[t][seq[t]].logprob) for t in range(plen, len(seq))])
        return result

    def sleep(self) -> bool:
        """Free the engine's GPU memory until `wake_up` (vLLM's sleep level 1: weights to host
        memory, KV cache dropped). Without `sleep_mode` (always on CPU) it does nothing. True when
        the engine sleeps now."""
        if self.config.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
        return self.asleep

    def wake_up(self) -> bool:
        """Take the engine's GPU memory back (weights and KV cache) after `sleep`; nothing when it
        is awake. True when it was asleep."""
        was = self.asleep
        if was:
            self.llm.wake_up()
            self.asleep = False
        return was

    def _check_awake(self, what: str) -> None:
        if self.asleep:
            raise VllmEngineError(f"the engine sleeps (its GPU memory is freed) and cannot {what}; "
                                  "call wake_up() first")

    def shutdown(self) -> None:
        """Free the engine (its KV cache and weights). vLLM's shutdown also destroys the default
        torch.distributed group of this process, even one it did not create: call it last."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        if self.adapter is not None:
            self.adapter.close()
