"""Pure checks of the vLLM engine's weight staging and of the sampling dict (no engine started)."""
from __future__ import annotations

import pytest
import torch

from xray.backends.sampling import SamplingError, SamplingSpec, call_seed
from xray.backends.vllm import FusedLayerStager, fused_layer_of

pytestmark = pytest.mark.unit

NAMES = ["model.embed_tokens.weight",
         "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
         "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias",
         "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.0.mlp.down_proj.weight"]


def test_fused_layer_names():
    assert fused_layer_of("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert fused_layer_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert fused_layer_of("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"


def test_stager_holds_a_fused_layer_until_complete():
    stager = FusedLayerStager(NAMES)
    t = torch.zeros(1)
    ready = stager.add([(NAMES[0], t), (NAMES[1], t), (NAMES[7], t)])
    assert [n for n, _ in ready] == [NAMES[0]]
    assert stager.waiting() == sorted([NAMES[1], NAMES[7]])
    ready = stager.add([(n, t) for n in NAMES[2:7]] + [(NAMES[9], t)])
    assert sorted(n for n, _ in ready) == sorted(NAMES[1:7] + [NAMES[9]])
    assert stager.waiting() == [NAMES[7]]
    ready = stager.add([(NAMES[8], t)])
    assert sorted(n for n, _ in ready) == sorted(NAMES[7:9])
    assert stager.waiting() == []


def test_stager_keeps_a_copy_of_what_it_holds_back():
    """A bucket's memory may be reused once its load returns (the shared-memory slots): the parts
    held back for a later bucket must not change with it."""
    stager = FusedLayerStager(NAMES)
    q, sent = torch.ones(2), torch.ones(2)
    stager.add([(NAMES[1], q), (NAMES[0], torch.zeros(1))])
    q.fill_(7.0)  # the slot written again with the next bucket
    ready = dict(stager.add([(n, torch.zeros(2)) for n in NAMES[2:7]]))
    assert torch.equal(ready[NAMES[1]], sent)


def test_sampling_spec_checks_keys_and_ranges():
    spec = SamplingSpec.from_dict({"temperature": 0, "stop_token_ids": [5, 6], "n": 2})
    assert spec.greedy and spec.stop_token_ids == (5, 6) and spec.top_k_or_none is None
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingSpec.from_dict({"max_tokens": 3})
    with pytest.raises(SamplingError, match="top_p"):
        SamplingSpec.from_dict({"top_p": 0.0})
    assert call_seed(SamplingSpec(seed=5), 0, 9) == 5
    assert call_seed(SamplingSpec(), 0, 1) != call_seed(SamplingSpec(), 0, 2)
    assert len({call_seed(SamplingSpec(), 0, 1) for _ in range(3)}) == 1  # the same on every call
