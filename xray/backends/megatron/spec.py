"""What the Megatron engine reads from a Hugging Face model directory, and the layout check.

First step of `xray.backends.megatron`: `read_spec` turns a local HF `config.json` (Llama,
Mistral, Qwen2, Qwen3 dense, Qwen3-MoE and Qwen2-MoE: `SUPPORTED_ARCHITECTURES`; plain or Llama 3
RoPE: `rope.py`) into a `ModelSpec`; `check_layout` validates a ParallelDims against it before
anything is built (the runtime calls it before starting any Workhorse); `transformer_config`
turns both into Megatron-core's `TransformerConfig`. Only `json` is read here: no torch model,
no Megatron import at module level, so the check is cheap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xray.backends.megatron.rope import Llama3Scaling, UnsupportedRopeError, read_rope
from xray.config.moe import MoeConfig
from xray.config.parallel import LayoutError, ParallelDims


@dataclass(frozen=True)
class Architecture:
    """What sets one supported HF architecture apart from Llama's decoder."""

    qkv_bias: bool | None
    """The q/k/v projections carry a bias (None: as the config's `attention_bias` says)."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys before RoPE (Qwen3's `q_norm`, `k_norm`)."""
    moe: bool = False
    """Every decoder layer's MLP is a mixture of experts (Qwen3-MoE's router and SwiGLU experts)."""


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": Architecture(qkv_bias=False),
    "MistralForCausalLM": Architecture(qkv_bias=False),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(qkv_bias=None, qk_norm=True),
    "Qwen3MoeForCausalLM": Architecture(qkv_bias=None, qk_norm=True, moe=True),
    "Qwen2MoeForCausalLM": Architecture(qkv_bias=True, moe=True),
}
"""The HF architectures the Megatron engine builds (dense decoders: RMSNorm, SwiGLU, RoPE, GQA)."""


class UnsupportedModelError(ValueError):
    """A Hugging Face model the Megatron engine cannot build; the message says what is supported."""


@dataclass(frozen=True)
class ModelSpec:
    """The sizes and options of a decoder-only HF model that the Megatron engine needs."""

    architecture: str
    """HF architecture name, a key of SUPPORTED_ARCHITECTURES."""
    vocab_size: int
    """Number of token ids (rows of the embedding)."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int
    """Width of one attention head."""
    rope_theta: float
    """RoPE base."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    max_position_embeddings: int
    """Longest sequence the model supports."""
    tie_word_embeddings: bool
    """The output layer shares the input embedding's weight."""
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2; Qwen3 where `attention_bias` is set)."""
    qk_norm: bool = False
    """Queries and keys are RMS-normalised per head before RoPE (Qwen3)."""
    num_experts: int = 0
    """Experts of each layer's mixture of experts (0: dense MLPs)."""
    experts_per_token: int = 0
    """Experts each token is routed to."""
    moe_intermediate_size: int = 0
    """One expert's SwiGLU inner width."""
    norm_topk_prob: bool = False
    """The top-k routing probabilities are renormalised to sum to 1."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (every token, gated by a sigmoid): its SwiGLU inner width (0: none)."""
    rope_scaling: Llama3Scaling | None = None
    """Llama 3's RoPE frequency scaling (`rope_type: llama3`); None: plain RoPE."""


def _rope(cfg: dict) -> tuple[float, Llama3Scaling | None]:
    try:
        return read_rope(cfg)
    except UnsupportedRopeError as exc:
        raise UnsupportedModelError(str(exc)) from None


def _check_options(cfg: dict, arch: str) -> None:
    unsupported = []
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' / SwiGLU)")
    if cfg.get("mlp_bias"):
        unsupported.append("mlp_bias=true")
    if SUPPORTED_ARCHITECTURES[arch].qkv_bias is False and cfg.get("attention_bias"):
        unsupported.append("attention_bias=true")
    if cfg.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true")
    window, longest = cfg.get("sliding_window"), int(cfg.get("max_position_embeddings", 4096))
    if arch == "MistralForCausalLM" and window is not None and int(window) < longest:
        unsupported.append(f"sliding_window={window} below max_position_embeddings={longest} "
                           "(windowed attention; Mistral v0.3 and later have sliding_window null)")
    sparse_every = int(cfg.get("decoder_sparse_step", 1))
    if SUPPORTED_ARCHITECTURES[arch].moe and (sparse_every != 1 or cfg.get("mlp_only_layers")):
        unsupported.append("dense layers among the experts' (decoder_sparse_step > 1 or mlp_only_layers)")
    if unsupported:
        raise UnsupportedModelError(
            f"{arch} with {', '.join(unsupported)} is not supported by the Megatron engine; "
            "use a checkpoint without it or the deepspeed backend.")


def read_spec(model_dir: str | Path) -> ModelSpec:
    """Read `model_dir/config.json` into a ModelSpec; raise UnsupportedModelError for other models."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a local Hugging Face model directory")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch or cfg.get('model_type')!r} is not supported by the Megatron "
            f"engine; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Convert the model "
            "or use the deepspeed backend.")
    _check_options(cfg, arch)
    known, heads = SUPPORTED_ARCHITECTURES[arch], int(cfg["num_attention_heads"])
    theta, scaling = _rope(cfg)
    return ModelSpec(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias")) if known.qkv_bias is None else known.qkv_bias,
        qk_norm=known.qk_norm, **(_moe_sizes(cfg) if known.moe else {}))


def _moe_sizes(cfg: dict) -> dict:
    """A mixture of experts' ModelSpec fields (transformers 5 saves Qwen3-MoE's expert count as
    `num_local_experts`)."""
    return dict(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
                experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def check_layout(model_dir: str | Path, parallel: ParallelDims) -> ModelSpec:
    """Raise LayoutError / UnsupportedModelError if `parallel` cannot shard this model; else its spec."""
    spec = read_spec(model_dir)
    parallel.check_model(spec.num_layers, spec.num_heads, spec.num_kv_heads)
    parallel.check_experts(spec.num_experts)
    if spec.num_experts and parallel.tp > 1:
        raise LayoutError(f"tp={parallel.tp} with a mixture of experts: Megatron's MoE layers need sequence "
                          "parallelism at tp > 1, which the CPU layer spec lacks; use tp=1 (with pp or dp)")
    if spec.vocab_size % parallel.tp:
        raise LayoutError(
            f"tp={parallel.tp} does not divide the vocabulary of {spec.vocab_size} tokens; "
            f"choose tp among the divisors of {spec.vocab_size}")
    return spec


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The global layer indices of each pipeline stage: equal shares, the first stage takes the rest."""
    base, rest = divmod(num_layers, pp)
    sizes = [base + rest] + [base] * (pp - 1)
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def transformer_config(spec: ModelSpec, parallel: ParallelDims, on_cpu: bool, dtype=None,
                       moe: MoeConfig = MoeConfig(), recompute: bool = False):
    """Megatron-core's TransformerConfig for `spec` under `parallel` with `dtype` parameters
    (fp32 by default; bf16 sets Megatron's `bf16` flag), no dropout, no fusions; `moe`: the
    router's load-balancing loss; `recompute`: Megatron's full activation recompute, each layer
    on its own (only its input is kept in a training forward)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = dtype or torch.float32
    first = stage_layers(spec.num_layers, parallel.pp)[0]
    uneven = parallel.pp > 1 and spec.num_layers % parallel.pp != 0
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        num_layers_in_first_pipeline_stage=len(first) if uneven else None,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True, **_moe_config(spec, parallel.ep, moe, recompute),
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}))


def _moe_config(spec: ModelSpec, ep: int, moe: MoeConfig, recompute: bool = False) -> dict:
    """Megatron's MoE settings that compute what Hugging Face's Qwen3-MoE and Qwen2-MoE do: no load
    balancing or auxiliary loss (unless `moe` asks for one), an fp32 router, softmax over the top-k
    logits (renormalised, `norm_topk_prob`) or top-k of the softmax (not), the experts one by one (no grouped GEMM), and
    Qwen2-MoE's shared expert gated by a sigmoid; the experts split over `ep` ranks, whose tokens
    the allgather dispatcher gathers (so those ranks run micro-batches of one shape together:
    `xray/backends/megatron/experts.py`)."""
    if not spec.num_experts:
        if moe != MoeConfig():
            raise UnsupportedModelError(f"moe options {moe} on a dense model (no experts): leave <role>.moe unset")
        return {}
    # ep > 1: the dispatcher's backward gathers on `torch.cuda.current_device()`, which `cpu_compat`
    # rewrites only while no other torch function is being handled; Megatron's own backward
    # (`deallocate_pipeline_outputs`) calls the autograd engine directly, outside torch.autograd.backward;
    # so does a recompute, whose router moves its weight to `torch.cuda.current_device()` in the backward
    return dict(num_moe_experts=spec.num_experts, expert_model_parallel_size=ep,
                deallocate_pipeline_outputs=ep > 1 or recompute,
                moe_router_topk=spec.experts_per_token, moe_ffn_hidden_size=spec.moe_intermediate_size,
                moe_router_load_balancing_type=moe.load_balancing, moe_aux_loss_coeff=moe.aux_loss_coef,
                moe_router_pre_softmax=not spec.norm_topk_prob, moe_router_dtype="fp32",
                moe_enable_routing_replay=moe.routing_replay,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size or None,
                moe_shared_expert_gate=bool(spec.shared_expert_intermediate_size))
