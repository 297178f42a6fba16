"""The rollout engines (vLLM, DeepSpeed-Inference) on the architectures beyond Llama (Qwen3 with
its per-head q/k norms, Mistral; Qwen3-MoE and Qwen2-MoE on DeepSpeed-Inference), fp32 on CPU,
against Hugging Face.

Per engine and architecture, one engine: the log-probs of its own samples equal HF's recomputation within
1e-5; an in-place reload of every tensor (the model trained further) is held exactly as sent,
every tensor checked (bit for bit where the engine keeps it readable, by its product where
vLLM's CPU engine keeps only a packed copy) and none unchecked; and the reloaded engine's log-probs equal
HF's with the new weights.
"""
from __future__ import annotations

import pytest

from tests.backends.rollout_common import changed_weights, hf_sequence_stats, make_prompts, max_abs_diff, sequences_of
from xray.backends import load_backend
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check.reference import load_hf

pytestmark = pytest.mark.backends

LOGPROB_TOL = 1e-5
HELD = {("vllm", "qwen3"): {"exact": 11, "functional": 8}, ("vllm", "mistral"): {"exact": 7, "functional": 8},
        ("dsinfer", "qwen3"): {"exact": 25, "functional": 0}, ("dsinfer", "mistral"): {"exact": 21, "functional": 0},
        ("dsinfer", "qwen3_moe"): {"exact": 25, "functional": 0},
        ("dsinfer", "qwen2_moe"): {"exact": 35, "functional": 0}}
"""What an engine holds of a whole reload. vLLM on CPU: the embedding, the head and the norms read back
(Qwen3's q/k norms too: 4 more), the 4 linear layers of each of 2 decoder layers (q/k/v and gate/up fused)
by product. DeepSpeed-Inference: every Hugging Face tensor read back (a mixture of experts' fused experts
too; vLLM's mixtures of experts: `test_vllm_moe.py`)."""


@pytest.mark.parametrize("backend,arch", sorted(HELD))
def test_samples_and_in_place_reload_match_hf(tmp_path, backend, arch):
    directory = build_tiny_model(tmp_path / arch, TinySpec(arch=arch), seed=0)
    hf = load_hf(str(directory))
    extra = {"max_model_len": 256, "kv_cache_gib": 1} if backend == "vllm" else {}
    engine = load_backend(backend).build_engine(directory, dtype="float32", seed=0, **extra)
    try:
        prompts = make_prompts(8, seed=7)
        out = engine.generate(prompts, {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "seed": 3})
        seqs, lens = sequences_of(out)
        assert max_abs_diff(engine.logprobs(seqs, lens), hf_sequence_stats(hf, seqs, lens)[0]) <= LOGPROB_TOL
        new = changed_weights(hf)  # trains `hf` in place
        engine.load_weights(new)
        held, holds = engine.held_check(), engine.held_tensors()
        assert sorted(held.pop("checked")) == sorted(holds), holds  # one verdict per engine tensor written
        assert held == {**HELD[backend, arch], "unchecked": 0, "mismatched": []}, held
        reloaded = engine.logprobs(seqs, lens)
        assert max_abs_diff(reloaded, hf_sequence_stats(hf, seqs, lens)[0]) <= LOGPROB_TOL
    finally:
        if backend == "vllm":
            engine.shutdown()
