"""The pieces of the vLLM engine's MoE handling that need no engine (`xray/backends/vllm_moe.py`):
which tensors make a block, per-expert coverage of fused names (the stager's and the sync's
completeness), and the reference the held check compares a block's forward with, against
transformers' own Qwen3-MoE and Qwen2-MoE blocks."""
from __future__ import annotations

import pytest
import torch

from xray.backends.expert_names import moe_block_of
from xray.backends.vllm_moe import Routing, expected_output, fused_aliases
from xray.sync.manifest import incomplete

pytestmark = pytest.mark.unit

PER_EXPERT = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up", "down")]


def test_block_names_and_coverage():
    assert moe_block_of("model.layers.3.mlp.experts.gate_up_proj") == "model.layers.3.mlp"
    assert moe_block_of("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp"
    assert moe_block_of("model.layers.3.mlp.shared_expert_gate.weight") == "model.layers.3.mlp"
    assert moe_block_of("model.layers.3.mlp.gate_proj.weight") is None  # a dense MLP
    routing = Routing(top_k=1, renormalize=False, num_experts=2)
    fused = routing.units("model.layers.0.mlp.experts.gate_up_proj") | \
        routing.units("model.layers.0.mlp.experts.down_proj")
    assert fused == set().union(*map(routing.units, PER_EXPERT)) and len(fused) == 6
    aliases = fused_aliases(PER_EXPERT + ["model.layers.0.mlp.gate.weight"])
    assert aliases == {"model.layers.0.mlp.experts.gate_up_proj": sorted(n for n in PER_EXPERT if "down" not in n),
                       "model.layers.0.mlp.experts.down_proj": sorted(n for n in PER_EXPERT if "down" in n)}
    names = {"needs": PER_EXPERT, "takes": PER_EXPERT, "aliases": aliases}
    sent = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    assert incomplete(None, {"loaded": sent, "names": names}) == []
    assert "needs were not sent" in incomplete(None, {"loaded": sent[:1], "names": names})[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_reference_equals_transformers_block(arch):
    from transformers import AutoModelForCausalLM

    from xray.builtin.tiny_llama import TinySpec, hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(TinySpec(arch=arch)), dtype=torch.float32)
    block = model.model.layers[0].mlp
    tensors = {k: v for k, v in model.state_dict().items() if moe_block_of(k) == "model.layers.0.mlp"}
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x[None])
    want = (want[0] if isinstance(want, tuple) else want).reshape(x.shape)
    got = expected_output(x, tensors, Routing(top_k=2, renormalize=True, num_experts=4))
    assert (got - want).abs().max() <= 1e-6
