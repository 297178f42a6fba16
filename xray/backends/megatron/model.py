"""Building one rank's Megatron-core GPTModel from a Hugging Face directory, and filling it.

Third step of `xray.backends.megatron`: `build_gpt` makes this rank's pipeline stage and
tensor-parallel shard of a Llama, Mistral, Qwen2 or Qwen3 dense model (RMSNorm, SwiGLU, RoPE with
the model's base and Llama 3's scaling where set, GQA, tied or untied embeddings, Qwen2's q/k/v
bias, Qwen3's per-head q/k norms) with Megatron's local layer spec, and with `recompute`
Megatron's full activation recompute; `load_hf` copies the HF weights into it through
`convert.to_shard`. A critic gets the same trunk with a scalar `ValueHead` in place of the output
layer, read from the directory's `score.weight` if present, else initialised from the seed.
"""
from __future__ import annotations

import logging

import torch

from xray.backends.megatron.convert import VALUE_HEAD, Entry, Kind, stage_entries, to_shard
from xray.backends.megatron.hf_weights import HFWeights
from xray.backends.megatron.rope import llama3_inverse_frequencies
from xray.backends.megatron.spec import ModelSpec, stage_layers, transformer_config
from xray.config.moe import MoeConfig
from xray.config.parallel import ParallelDims

logger = logging.getLogger(__name__)

ROLES = ("actor", "reference", "critic")
# core-attention choices: torch's fused SDPA kernel, or Megatron's own DotProductAttention
ATTENTIONS = ("sdpa", "megatron")


class ValueHead(torch.nn.Module):
    """The critic's scalar head, in the output layer's place: hidden [s, b, h] -> ([s, b, 1], None).

    Replicated on every tensor-parallel rank (its input, the final norm's output, is replicated)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight), None


def layer_spec(attention: str, qk_norm: bool = False, num_experts: int = 0):
    """Megatron's local GPT layer spec (RMSNorm; with `qk_norm`, RMSNorms over each head's queries
    and keys; with `num_experts`, a mixture of experts run one expert after another), with SDPA
    core attention unless "megatron"."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if num_experts:  # without Transformer Engine its fused router GEMM is an undefined name: torch's
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    layer = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False,
                                     normalization="RMSNorm", qk_layernorm=qk_norm)
    if attention == "sdpa":
        from xray.backends.megatron.attention import SDPAttention

        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return layer


def build_gpt(spec: ModelSpec, parallel: ParallelDims, role: str, on_cpu: bool, attention: str,
              dtype: torch.dtype = torch.float32, moe: MoeConfig = MoeConfig(), recompute: bool = False):
    """This rank's GPTModel in `dtype` (parameters uninitialised; fill them with `load_hf`);
    `recompute`: full activation recompute, layer by layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, parallel, on_cpu, dtype, moe, recompute)
    critic = role == "critic"
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(attention, spec.qk_norm, spec.num_experts),
        vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=True, position_embedding_type="rope", rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not critic)
    if critic and model.post_process:
        model.output_layer = ValueHead(spec.hidden_size).to(dtype)
    if spec.rope_scaling is not None:  # Megatron's own llama3 option fixes three of its four parameters
        model.rotary_pos_emb.inv_freq = llama3_inverse_frequencies(spec.rope_theta, spec.head_dim, spec.rope_scaling)
    first = stage_layers(spec.num_layers, parallel.pp)[ps.get_pipeline_model_parallel_rank()].start
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    assert numbers == list(range(first, first + len(numbers))), (numbers, first)
    return model


def init_value_head(weight: torch.Tensor, seed: int) -> torch.Tensor:
    """The seeded initial value head: normal with std 1/(hidden+1), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(weight.shape, generator=gen) / (weight.shape[-1] + 1)


def load_hf(model: torch.nn.Module, entries: list[Entry], weights: HFWeights, spec: ModelSpec,
            tp_rank: int, tp: int, seed: int) -> None:
    """Copy this shard's part of the HF weights into `model` (every parameter must be covered)."""
    params = dict(model.named_parameters())
    expected = {e.megatron_name for e in entries}
    assert expected == set(params), (sorted(expected ^ set(params)))
    with torch.no_grad():
        for entry in entries:
            target = params[entry.megatron_name]
            if entry.hf_names == (VALUE_HEAD,) and VALUE_HEAD not in weights:
                logger.info("no %s in %s: the value head starts from seed %d",
                            VALUE_HEAD, weights.model_dir, seed)
                target.copy_(init_value_head(target, seed))
                continue
            shard = to_shard(entry, [weights.get(n) for n in entry.hf_names], spec, tp_rank, tp)
            if shard.shape != target.shape:
                raise ValueError(f"{entry.megatron_name}: HF tensors give a shard of shape "
                                 f"{tuple(shard.shape)}, the model expects {tuple(target.shape)}; "
                                 "does config.json match the weights?")
            target.copy_(shard)


def build_and_load(model_dir: str, spec: ModelSpec, parallel: ParallelDims, role: str,
                   on_cpu: bool, seed: int, attention: str, dtype: torch.dtype = torch.float32,
                   moe: MoeConfig = MoeConfig(), recompute: bool = False) -> tuple[torch.nn.Module, list[Entry]]:
    """Build this rank's model in `dtype` and fill it from `model_dir` (rounded to nearest when
    bf16); returns it with its entries."""
    from megatron.core import parallel_state as ps

    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    model = build_gpt(spec, parallel, role, on_cpu, attention, dtype, moe, recompute)
    ep_rank = ps.get_expert_model_parallel_rank() if spec.num_experts else None
    entries = stage_entries(spec, pp_rank, parallel.pp, critic=role == "critic", ep=parallel.ep, ep_rank=ep_rank)
    load_hf(model, entries, HFWeights(model_dir), spec, tp_rank, parallel.tp, seed)
    mark_tensor_parallel(model, entries, parallel.tp)
    return model, entries


def mark_tensor_parallel(model: torch.nn.Module, entries: list[Entry], tp: int) -> None:
    """Set Megatron's `tensor_model_parallel` flag on the sharded parameters, as Megatron's
    layers do when they initialise their own weights (`perform_initialization=False` skips it):
    its optimizer counts a parameter without the flag in the gradient norm on tp rank 0 only."""
    params = dict(model.named_parameters())
    for entry in entries:
        param = params[entry.megatron_name]
        if not getattr(param, "tensor_model_parallel", False):
            param.tensor_model_parallel = tp > 1 and entry.kind is not Kind.REPLICATED
