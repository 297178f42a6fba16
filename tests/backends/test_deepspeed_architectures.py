"""DeepSpeed ZeRO-3 at dp=2 on the architectures beyond Llama (Qwen3 with its per-head q/k norms,
Mistral, and the mixtures of experts Qwen3-MoE and Qwen2-MoE, whose experts the export sends fused,
as transformers 5 holds them) against the unsharded Hugging Face model.

The DeepSpeed engine runs whatever `transformers` loads, so nothing in it is per-architecture;
this checks that it stays so. One spawn (2 gloo processes) builds each architecture's engine in
turn: log-probs within 1e-5 of HF's, one train step's loss and gradient norm against
`reference_train_step` (1e-5 relative), and every exported weight after it (1e-5 relative, the
bound `test_deepspeed_zero` explains).
`llama3_recompute` is a Llama with Llama 3's RoPE scaling (transformers applies it) trained with
activation checkpointing (transformers' gradient checkpointing under ZeRO-3): the same step as the
reference's, with each decoder layer run twice per micro-batch.
"""
from __future__ import annotations

import functools
import gc
import json
from pathlib import Path

import pytest
import torch

from tests.backends.test_deepspeed_zero import MICRO, OPT
from tests.backends.test_megatron_parity import LLAMA3_ROPE
from tests.dist_harness import run_distributed
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check.reference import hf_logprobs, load_hf, max_rel_diff, policy_loss, random_batch, reference_train_step
from xray.config.parallel import ParallelDims
from xray.data import columns as C

pytestmark = pytest.mark.backends

DP = 2
SPECS = {"qwen3": TinySpec(arch="qwen3", tie_word_embeddings=True), "mistral": TinySpec(arch="mistral"),
         "qwen3_moe": TinySpec(arch="qwen3_moe"), "qwen2_moe": TinySpec(arch="qwen2_moe"),
         "llama3_recompute": TinySpec(arch="llama")}
RECOMPUTED = ("llama3_recompute",)  # trained with activation checkpointing


def _zero3(rank, world, model_dirs: dict[str, str], batch) -> dict:
    from xray.backends.deepspeed import build_engine

    part, out = batch.split(world)[rank], {}
    for arch, model_dir in model_dirs.items():
        engine = build_engine(model_dir, ParallelDims(dp=world), "actor", OPT, seed=0, zero_stage=3,
                              activation_checkpointing=arch in RECOMPUTED)
        logprobs = engine.forward(part)[C.LOGPROBS].numpy()
        calls = [0]  # forwards of the first decoder layer in the step
        layer = engine.engine.module.model.layers[0]
        counting = layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        metrics = engine.train_step(part, policy_loss, MICRO)
        counting.remove()
        weights = {n: t.numpy() for b in engine.export_weights() for n, t in b}
        out[arch] = {"logprobs": logprobs, "metrics": metrics, "weights": weights, "layer_calls": calls[0]}
        del engine
        gc.collect()
    return out


@functools.lru_cache(maxsize=None)
def _setup():
    import tempfile

    root = tempfile.mkdtemp(prefix="xray-ds-arch-")
    dirs = {arch: str(build_tiny_model(f"{root}/{arch}", spec, seed=0)) for arch, spec in SPECS.items()}
    config = Path(dirs["llama3_recompute"]) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_parameters": LLAMA3_ROPE}))
    batch = random_batch(8, 16, 256, seed=1)
    return dirs, batch, run_distributed(_zero3, DP, dirs, batch)


def _reference(model_dir: str, batch) -> dict:
    model = load_hf(model_dir)
    with torch.no_grad():
        logprobs = hf_logprobs(model, batch)
    micro = batch.chunks(MICRO)
    for mb in micro:
        (policy_loss({C.LOGPROBS: hf_logprobs(model, mb)}, mb)[0] / len(micro)).backward()
    grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    loss = reference_train_step(model, batch, policy_loss, OPT, MICRO)[0]
    return {"logprobs": logprobs, "grad_norm": grad_norm, "loss": loss,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_zero3_matches_hf(arch):
    dirs, batch, per_rank = _setup()
    ref = _reference(dirs[arch], batch)
    res = [r[arch] for r in per_rank]
    logprobs = torch.cat([torch.from_numpy(r["logprobs"]) for r in res])
    assert (logprobs - ref["logprobs"]).abs().max() <= 1e-5
    m = res[0]["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    weights = {n: torch.from_numpy(t) for n, t in res[0]["weights"].items()}
    assert sorted(weights) == sorted(ref["weights"]) and not res[1]["weights"]  # rank 0 exports every tensor
    assert ("model.layers.0.self_attn.q_norm.weight" in weights) == arch.startswith("qwen3")
    assert ("model.layers.0.mlp.experts.gate_up_proj" in weights) == arch.endswith("moe")
    assert max_rel_diff(weights, ref["weights"]) <= 1e-5
    assert [r["layer_calls"] for r in res] == [8 // DP // MICRO * (2 if arch in RECOMPUTED else 1)] * DP
