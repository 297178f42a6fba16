"""Tiny random Hugging Face models built locally: what tests, checks and benchmarks run on.

There is no model hub on our machines, so every test builds its model here: a real
`transformers` Llama, Mistral, Qwen2, Qwen3 or Qwen3/Qwen2 mixture-of-experts directory
(config.json + safetensors), seeded, small enough for CPU.
vLLM's CPU attention needs head_dim >= 32, so the defaults keep head_dim = 32.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny decoder-only model."""

    arch: str = "llama"
    """`llama`, `mistral` (Llama's decoder, no sliding window), `qwen2` (adds biases on q/k/v),
    `qwen3` (dense: RMSNorms over each head's queries and keys), or the mixtures of experts
    `qwen3_moe` and `qwen2_moe` (with a shared expert)."""
    vocab_size: int = 256
    """Token ids are 0..vocab_size-1."""
    hidden_size: int = 128
    """Model width; head_dim = hidden_size / num_heads."""
    intermediate_size: int = 256
    """SwiGLU inner width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    head_dim: int | None = None
    """Width of one attention head; None: hidden_size / num_heads. Qwen3 sets it apart (Qwen3-0.6B:
    128 with hidden 1024 and 16 heads). Not for `qwen2` and `qwen2_moe`, whose configs derive it."""
    max_position_embeddings: int = 512
    """Longest sequence."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    num_experts: int = 4
    """Experts per MoE block (`qwen3_moe`, `qwen2_moe`; every layer is one)."""
    experts_per_token: int = 2
    """Experts each token is routed to."""
    moe_intermediate_size: int = 64
    """One expert's SwiGLU inner width (Qwen2-MoE's shared expert: `intermediate_size`)."""


# The benchmark model of the issues: a Llama of 27.4M parameters (untied 8192-token embedding and
# head: 8.4M; 6 layers of hidden 512: 19.0M), named by its real count.
BENCH_27M = TinySpec(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_layers=6,
                     num_heads=8, num_kv_heads=8, max_position_embeddings=1024)
# The larger benchmark model (bf16 figures ask for >= 100M): a Llama of 110.1M parameters (untied
# 16384-token embedding and head: 25.2M; 12 layers of hidden 768, 12 heads of 64: 84.9M).
BENCH_110M = TinySpec(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=12,
                      num_heads=12, num_kv_heads=12, max_position_embeddings=1024)
# The GPU benchmark model: a Llama of 1.04B parameters (untied 32000-token embedding and head: 131M;
# 18 layers of hidden 2048, 16 heads of 128, SwiGLU 5504: 911M).
BENCH_1B = TinySpec(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_layers=18,
                    num_heads=16, num_kv_heads=16, max_position_embeddings=4096)
BENCH_MODELS = {"27M": BENCH_27M, "110M": BENCH_110M, "1B": BENCH_1B}
"""The benchmark models by name (`--model` of the benchmarks)."""


def hf_config(spec: TinySpec):
    """The `transformers` config object for `spec`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
                  tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    if spec.arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim)
    if spec.head_dim is not None and spec.arch in ("qwen2", "qwen2_moe") \
            and spec.head_dim != spec.hidden_size // spec.num_heads:
        raise ValueError(f"head_dim={spec.head_dim}: {spec.arch} derives it from hidden_size / num_heads; "
                         "leave head_dim unset or use arch qwen3, llama or mistral")
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, use_sliding_window=False, attention_bias=False)
    if spec.arch == "mistral":
        return MistralConfig(**common, head_dim=head_dim, sliding_window=None)
    moe = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
               moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], router_aux_loss_coef=0.0)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=head_dim, use_sliding_window=False, attention_bias=False)
    if spec.arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=spec.intermediate_size,
                              use_sliding_window=False)
    raise ValueError(f"unknown tiny architecture {spec.arch!r}; use llama, mistral, qwen2, qwen3, qwen3_moe "
                     "or qwen2_moe")


def build_tiny_model(directory: str | Path, spec: TinySpec = TinySpec(), seed: int = 0,
                     init_std: float = 0.02) -> Path:
    """Write a seeded random model of `spec` to `directory` and return its path."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    config = hf_config(spec)
    config.initializer_range = init_std
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if spec.arch in ("qwen2", "qwen2_moe"):  # give the q/k/v biases non-zero values so they are exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=init_std)
        if spec.arch in ("qwen3", "qwen3_moe"):  # q/k norm weights away from their initial ones, so they matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    finally:
        torch.random.set_rng_state(gen_state)
    directory.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-file tiny model needs no "Writing model shards" bar
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return directory


BUILTIN_MODEL = "builtin:tiny-llama"
"""`model.path` of the default job: the model below, warm-started (`algorithms.warm_start`)."""


def builtin_spec() -> TinySpec:
    """The default job's tiny Llama (344K parameters) over the character tokenizer."""
    from xray.data.tokenizer import VOCAB_SIZE

    return TinySpec(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, max_position_embeddings=128)


TEACHER_MODEL = "builtin:tiny-llama-teacher"
"""`teacher.model_path` of on-policy distillation's default job: the model below, warm-started longer."""


def teacher_spec() -> TinySpec:
    """The built-in teacher: a larger tiny Llama (3.2M parameters) over the same character tokenizer."""
    from xray.data.tokenizer import VOCAB_SIZE

    return TinySpec(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_layers=4,
                    num_heads=8, num_kv_heads=4, max_position_embeddings=128)


def build_base_model(directory: Path, seed: int, spec: TinySpec | None = None) -> Path:
    """The seeded built-in tiny Llama (or `spec`) with the character tokenizer, before any training."""
    from xray.data.tokenizer import save_char_tokenizer

    build_tiny_model(directory, spec or builtin_spec(), seed=seed)
    save_char_tokenizer(directory)
    return directory
