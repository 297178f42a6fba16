"""Megatron engine pieces that need no process group: layout checks, weight layout, plans.

Bad layouts and unsupported models must fail in `check_layout` / `build_engine` before anything
is built; the HF <-> Megatron tensor layout must round-trip bitwise for every tp.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from xray.backends.megatron import UnsupportedModelError, build_engine, check_layout
from xray.backends.megatron.checkpoint import CheckpointMismatchError, load_shard, save_shard
from xray.backends.megatron.convert import Kind, from_shards, shard_shape, stage_entries, to_shard
from xray.backends.megatron.export import plan_buckets
from xray.backends.megatron.spec import ModelSpec, read_spec, stage_layers
from xray.config.parallel import LayoutError, ParallelDims

pytestmark = pytest.mark.unit

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def _model_dir(tmp_path, **changes) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **changes}))
    return str(tmp_path)


@pytest.mark.parametrize("dims,words", [
    ((3, 1, 1), "4 attention heads"),
    ((4, 1, 1), "2 key/value heads"),
    ((1, 3, 1), "2 layers"),
])
def test_bad_layouts_fail_before_building(tmp_path, dims, words):
    model_dir = _model_dir(tmp_path)
    with pytest.raises(LayoutError, match=words):
        check_layout(model_dir, ParallelDims(*dims))
    # no process group exists here: the layout error must come first
    with pytest.raises(LayoutError, match=words):
        build_engine(model_dir, ParallelDims(*dims), "actor")


def test_vocab_must_split_over_tp(tmp_path):
    with pytest.raises(LayoutError, match="vocabulary of 255"):
        check_layout(_model_dir(tmp_path, vocab_size=255), ParallelDims(tp=2))


@pytest.mark.parametrize("changes,words", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'.*default, llama3"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}},
     "lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 64, "max_position_embeddings": 4096},
     "sliding_window=64 below max_position_embeddings=4096"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4}, "MixtralForCausalLM.*supported: Llama"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "decoder_sparse_step": 2}, "dense layers among the experts'"),
])
def test_unsupported_models_are_named(tmp_path, changes, words):
    with pytest.raises(UnsupportedModelError, match=words):
        build_engine(_model_dir(tmp_path, **changes), ParallelDims(), "actor")


def test_read_spec(tmp_path):
    spec = read_spec(_model_dir(tmp_path, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                                rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert (spec.head_dim, spec.num_kv_heads, spec.rope_theta) == (32, 2, 1e6)
    assert spec.qkv_bias and spec.tie_word_embeddings and not spec.qk_norm
    qwen3 = read_spec(_model_dir(tmp_path, architectures=["Qwen3ForCausalLM"], head_dim=64))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (64, True, False)
    assert read_spec(_model_dir(tmp_path, architectures=["Qwen3ForCausalLM"], attention_bias=True)).qkv_bias
    mistral = read_spec(_model_dir(tmp_path, architectures=["MistralForCausalLM"], sliding_window=None))
    assert not (mistral.qkv_bias or mistral.qk_norm) and mistral.rope_scaling is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    for where in ({"rope_parameters": {"rope_theta": 5e5, **llama3}},  # transformers 5, and before it
                  {"rope_theta": 5e5, "rope_parameters": None, "rope_scaling": {**llama3, "rope_type": None,
                                                                                "type": "llama3"}}):
        spec = read_spec(_model_dir(tmp_path, **where))
        scaling = spec.rope_scaling
        assert spec.rope_theta == 5e5 and (scaling.factor, scaling.original_max_position_embeddings) == (8.0, 8192)


def test_moe_spec_layout_and_fused_experts(tmp_path):
    from safetensors.torch import save_file

    from xray.backends.megatron.hf_weights import HFWeights

    moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True}
    spec = read_spec(_model_dir(tmp_path, **moe))
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size) == (4, 2, 32) and spec.norm_topk_prob
    with pytest.raises(LayoutError, match="use tp=1"):
        check_layout(str(tmp_path), ParallelDims(tp=2))
    names = [e.hf_names for e in stage_entries(spec, 0, 1) if ".mlp." in e.megatron_name]
    assert names[0] == ("model.layers.0.mlp.gate.weight",) and len(names) == 2 * (1 + 2 * 4)
    g = torch.Generator().manual_seed(0)  # a directory with the experts fused, as transformers 5 holds them
    gate_up, down = torch.randn(4, 64, 128, generator=g), torch.randn(4, 128, 32, generator=g)
    save_file({"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down},
              str(tmp_path / "model.safetensors"))
    weights = HFWeights(tmp_path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in weights
    assert torch.equal(weights.get("model.layers.0.mlp.experts.3.up_proj.weight"), gate_up[3, 32:])
    assert torch.equal(weights.get("model.layers.0.mlp.experts.1.gate_proj.weight"), gate_up[1, :32])
    assert torch.equal(weights.get("model.layers.0.mlp.experts.2.down_proj.weight"), down[2])


def test_stage_layers_uneven():
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in stage_layers(6, 4)] == [3, 1, 1, 1]
    assert [list(r) for r in stage_layers(4, 2)] == [[0, 1], [2, 3]]


SPEC = ModelSpec(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rope_theta=1e4,
                 rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True)


QWEN3 = dataclasses.replace(SPEC, architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("spec", [SPEC, QWEN3], ids=["qwen2", "qwen3"])
def test_shards_round_trip_bitwise(tp, spec):
    g = torch.Generator().manual_seed(0)
    entries = stage_entries(spec, 0, 1) + stage_entries(spec, 1, 2)
    assert sum(e.tp_partial for e in entries) == (6 if spec.qk_norm else 0)  # q and k norms of 3 layer copies
    for entry in entries:
        full = [torch.randn(_full_shape(name), generator=g) for name in entry.hf_names]
        shards = [to_shard(entry, full, spec, r, tp) for r in range(tp)]
        assert all(tuple(s.shape) == shard_shape(entry, spec, tp) for s in shards), entry
        back = from_shards(entry, shards, spec)
        assert all(torch.equal(a, b) for a, b in zip(back, full)), entry


def _full_shape(name: str) -> tuple[int, ...]:
    s, h, d = SPEC, SPEC.hidden_size, SPEC.head_dim
    if "embed_tokens" in name or "lm_head" in name:
        return (s.vocab_size, h)
    if "q_norm" in name or "k_norm" in name:  # Qwen3's, over one head
        return (d,)
    if "norm" in name:
        return (h,)
    for proj, rows in (("q_proj", s.num_heads * d), ("k_proj", s.num_kv_heads * d), ("v_proj", s.num_kv_heads * d)):
        if proj in name:
            return (rows,) if name.endswith("bias") else (rows, h)
    if "o_proj" in name:
        return (h, s.num_heads * d)
    if "down_proj" in name:
        return (h, s.intermediate_size)
    return (s.intermediate_size, h)  # gate_proj, up_proj


def test_qkv_layout_groups_heads_with_their_kv():
    """Megatron's fused rows for group g: the q heads of g, then k of g, then v of g."""
    d, per_group = SPEC.head_dim, SPEC.num_heads // SPEC.num_kv_heads
    entry = next(e for e in stage_entries(SPEC, 0, 1) if e.kind is Kind.QKV and e.megatron_name.endswith("bias"))
    q = torch.arange(SPEC.num_heads * d, dtype=torch.float32)
    k = 1000 + torch.arange(SPEC.num_kv_heads * d, dtype=torch.float32)
    v = 2000 + torch.arange(SPEC.num_kv_heads * d, dtype=torch.float32)
    shard = to_shard(entry, [q, k, v], SPEC, tp_rank=1, tp=2)  # groups 2 and 3
    block = shard[: (per_group + 2) * d]
    assert torch.equal(block[: per_group * d], q[2 * per_group * d: 3 * per_group * d])
    assert torch.equal(block[per_group * d: (per_group + 1) * d], k[2 * d: 3 * d])
    assert torch.equal(block[(per_group + 1) * d:], v[2 * d: 3 * d])


def test_tied_copy_is_not_exported():
    tied = ModelSpec(**{**SPEC.__dict__, "tie_word_embeddings": True})
    last = stage_entries(tied, 1, 2)
    assert [e.exported for e in last if e.megatron_name == "output_layer.weight"] == [False]
    assert not any(e.megatron_name == "output_layer.weight" for e in stage_entries(tied, 0, 1))
    names = [n for b in plan_buckets(tied, ParallelDims(pp=2), False, 1 << 30) for p in b
             for n in p.entry.hf_names]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names


def test_buckets_respect_the_bound():
    bound = 20_000
    buckets = plan_buckets(SPEC, ParallelDims(tp=2), critic=False, bucket_bytes=bound)
    assert len(buckets) > 1
    for bucket in buckets:
        sizes = [sum(_numel(n) for n in p.entry.hf_names) * 4 for p in bucket]
        assert sum(sizes) <= bound or len(bucket) == 1


def _numel(name: str) -> int:
    return int(torch.Size(_full_shape(name)).numel())


def test_checkpoint_from_another_layout_is_refused(tmp_path):
    save_shard(tmp_path, 0, {"parallel": {"tp": 2}}, {"step": 3})
    assert load_shard(tmp_path, 0, {"parallel": {"tp": 2}})["step"] == 3
    with pytest.raises(CheckpointMismatchError, match="same model, role and tp/pp/dp"):
        load_shard(tmp_path, 0, {"parallel": {"tp": 1}})


def test_entropy_is_computed_only_when_read():
    from xray.backends.megatron.logprobs import PolicyOutputs
    from xray.data import columns as C

    calls = []
    outputs = PolicyOutputs(torch.zeros(2, 3), lambda: calls.append(1) or torch.ones(2, 3))
    assert C.ENTROPY in outputs and C.VALUES not in outputs and not calls
    entropy = outputs.get(C.ENTROPY)
    assert torch.equal(entropy, torch.ones(2, 3)) and outputs[C.ENTROPY] is entropy  # computed once, kept
    assert calls == [1]
    with pytest.raises(KeyError, match="policy head"):
        outputs[C.VALUES]


def test_llama3_frequencies_are_the_ones_transformers_computes():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xray.backends.megatron.rope import llama3_inverse_frequencies, read_rope

    params = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    theta, scaling = read_rope(config.to_dict())
    ours = llama3_inverse_frequencies(theta, 64, scaling)
    assert torch.equal(ours, theirs)
    plain = 1.0 / (5e5 ** (torch.arange(0, 64, 2).float() / 64))
    kept, divided = (ours == plain).sum().item(), (ours == plain / 8).sum().item()
    assert kept >= 2 and divided >= 2 and kept + divided < 32  # some kept, some scaled, some blended


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("spec", [SPEC, QWEN3], ids=["qwen2", "qwen3"])
def test_shard_digests_compose_to_the_hf_tensors(tp, spec):
    """The export check's own map of shard pieces to HF coordinates (not `from_shards`): the
    digests of every tp shard's pieces combine to each full HF tensor's digest, exactly; a
    one-element change in one shard, or two shards exchanged, changes the combination."""
    from xray.backends.export_digest import combine, digest
    from xray.backends.megatron.export_check import pieces

    g = torch.Generator().manual_seed(0)
    for entry in stage_entries(spec, 0, 1):
        full = [torch.randn(_full_shape(name), generator=g) for name in entry.hf_names]
        shards = [to_shard(entry, full, spec, r, tp) for r in range(tp)]

        def combined(shards):
            parts = {i: [] for i in range(len(entry.hf_names))}
            for r, shard in enumerate(shards[:1] if entry.kind is Kind.REPLICATED else shards):
                for i, piece, row0, col0 in pieces(entry, shard, spec, r):
                    parts[i].append(digest(piece, row0, col0))
            return [combine(torch.stack(p)) for p in parts.values()]

        assert all(torch.equal(c, digest(t)) for c, t in zip(combined(shards), full)), entry
        if entry.kind is Kind.REPLICATED or tp == 1:
            continue
        bad = [s.clone() for s in shards]
        bad[1].view(-1)[3] += 1.0
        assert not all(torch.equal(c, digest(t)) for c, t in zip(combined(bad), full)), entry
        swapped = [shards[1], shards[0], *shards[2:]]
        assert not all(torch.equal(c, digest(t)) for c, t in zip(combined(swapped), full)), entry
