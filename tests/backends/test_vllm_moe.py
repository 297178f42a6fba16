"""vLLM's in-place reload of mixture-of-experts models (tiny Qwen3-MoE and Qwen2-MoE with its
shared expert, fp32 on CPU), against a freshly built engine and Hugging Face.

vLLM's CPU experts keep their weights packed for the kernel, and its in-place reload writes raw
tensors over them (`xray/backends/vllm_moe.py`): without the re-preparation the engine silently
computes something else. Per architecture: the engine's log-probs of its own samples equal HF's;
the model trained further is reloaded in buckets of 3 tensors (so blocks arrive in parts and are
held back until whole), every block checked by its forward and nothing unchecked; the reloaded
engine's log-probs equal those of an engine built fresh from the new weights, and HF's, within
1e-5. Then a reload that skips the re-preparation is caught: every block it touched is named
mismatched, and the sync's judgement (`check_exact`) raises.
"""
from __future__ import annotations

import pytest
import torch

from tests.backends.rollout_common import changed_weights, hf_sequence_stats, make_prompts, max_abs_diff, sequences_of
from xray.backends import load_backend, vllm_moe
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check.reference import load_hf
from xray.sync import WeightSyncError
from xray.sync.weights import check_exact

pytestmark = pytest.mark.backends

LOGPROB_TOL = 1e-5
LAYERS = TinySpec().num_layers


def _engine(directory):
    return load_backend("vllm").build_engine(directory, dtype="float32", seed=0, max_model_len=256, kv_cache_gib=1)


@pytest.mark.parametrize("arch,block_tensors", [("qwen3_moe", 3), ("qwen2_moe", 7)])
def test_moe_reload_in_place_equals_a_fresh_engine(tmp_path, monkeypatch, arch, block_tensors):
    directory = build_tiny_model(tmp_path / "start", TinySpec(arch=arch), seed=0)
    hf = load_hf(str(directory))
    original = [(k, v.detach().clone()) for k, v in hf.state_dict().items()]
    engine = _engine(directory)
    try:
        out = engine.generate(make_prompts(8, seed=7), {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "seed": 3})
        seqs, lens = sequences_of(out)
        assert max_abs_diff(engine.logprobs(seqs, lens), hf_sequence_stats(hf, seqs, lens)[0]) <= LOGPROB_TOL
        new = changed_weights(hf)  # trains `hf` in place
        for i in range(0, len(new), 3):  # buckets cut through the blocks: each reloaded once whole
            engine.load_weights(new[i:i + 3])
        assert engine.pending_weights() == []
        held = engine.held_check()
        assert held["unchecked"] == 0 and held["mismatched"] == [], held
        assert held["functional"] >= LAYERS * block_tensors, held  # router and experts (and shared expert)
        reloaded = engine.logprobs(seqs, lens)
        assert max_abs_diff(reloaded, hf_sequence_stats(hf, seqs, lens)[0]) <= LOGPROB_TOL
        monkeypatch.setattr(vllm_moe, "reprepare", lambda model, blocks: 0)  # the kernel left as it is
        engine.load_weights(original)
        held = engine.held_check()
        assert len(held["mismatched"]) == LAYERS and all("MoE block" in m for m in held["mismatched"]), held
        with pytest.raises(WeightSyncError, match="otherwise than sent"):
            check_exact(1, [{"held": held}])
    finally:
        engine.shutdown()
    hf.save_pretrained(tmp_path / "new", safe_serialization=True)
    fresh = _engine(tmp_path / "new")
    try:
        assert max_abs_diff(fresh.logprobs(seqs, lens), reloaded) <= LOGPROB_TOL
    finally:
        fresh.shutdown()


def test_one_expert_one_optimizer_step_stale_is_caught(tmp_path, monkeypatch):
    """The engine writes one expert of one block as it was one optimizer step before (lr 1e-5, Adam's
    first step: every element moved by the learning rate) while the rest of the sync lands: the
    block's check, whose probe runs every expert (`vllm_moe.routed_probe`), names that block alone
    (seen: 0.035% of a token's output rms, against the fp32 bound of 0.01%)."""
    directory = build_tiny_model(tmp_path / "start", TinySpec(arch="qwen3_moe"), seed=0)
    hf = load_hf(str(directory))
    engine = _engine(directory)
    try:
        new = changed_weights(hf)
        name = "model.layers.1.mlp.experts.down_proj"
        sent = dict(new)[name]
        stale = sent.clone()
        stale[3] -= 1e-5 * torch.sign(torch.randn(stale[3].shape, generator=torch.Generator().manual_seed(0)))
        reload = engine.reload
        monkeypatch.setattr(engine, "reload", lambda tensors: reload([(n, stale if n == name else t) for n, t in tensors]))
        engine.load_weights(new)
        held = engine.held_check()
        assert len(held["mismatched"]) == 1 and held["mismatched"][0].startswith("model.layers.1.mlp (MoE block: "), held
        assert "of its rms from the sent tensors' output, bound 0.0001" in held["mismatched"][0], held
        assert held["functional"] == 10 - 3 and held["unchecked"] == 0, held  # a correct sync: 10, this block's 3
    finally:
        engine.shutdown()
