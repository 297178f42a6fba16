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


@pytest.mark.parametrize("experts, top_k, hidden", [(4, 2, 128), (128, 8, 512), (60, 4, 256)])
def test_the_block_probe_runs_every_expert_with_a_real_share(experts, top_k, hidden):
    """Random rows alone leave experts idle at top-8 of 128 (16 rows run about two thirds); the
    routed rows put each expert in some row's top-k, with a weight no rounding of bf16 reorders."""
    from xray.backends.vllm_moe import PROBE_TOKENS, experts_run, routed_probe

    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(1)) * 0.02
    routing = Routing(top_k=top_k, renormalize=False, num_experts=experts)
    x = routed_probe(router, routing)
    random_rows = experts_run(x[:PROBE_TOKENS], router, routing)
    assert experts_run(x, router, routing) == set(range(experts))
    assert experts_run(x.bfloat16().float(), router.bfloat16().float(), routing) == set(range(experts))
    if experts == 128:
        assert len(random_rows) < experts  # what the random rows alone would have left unchecked
    probs = torch.softmax(x[PROBE_TOKENS:] @ router.T, dim=-1)
    assert float(probs.topk(top_k, dim=-1).values.min()) > 0.01  # each routed expert weighs in
