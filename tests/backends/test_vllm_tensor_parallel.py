"""vLLM with tensor parallelism 2 on CPU: two processes in a gloo group, vLLM in-process on each
(its `external_launcher` mode), checked against Hugging Face on the same process."""
from __future__ import annotations

import pytest

from tests.backends.rollout_common import (changed_weights, hf_greedy, hf_sequence_stats,
                                           make_prompts, max_abs_diff, trained_tiny_model)
from tests.dist_harness import run_distributed
from xray.backends import load_backend
from xray.check.reference import load_hf
from xray.data import columns as C

pytestmark = pytest.mark.backends

NEW_TOKENS = 16


def _tp_worker(rank, world_size, model_dir):
    hf = load_hf(model_dir)
    prompts = make_prompts(16)
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    engine = load_backend("vllm").build_engine(model_dir, tp=world_size, max_model_len=256)
    try:
        qkv = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model \
            .model.layers[0].self_attn.qkv_proj.output_size_per_partition
        greedy = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
        sampled = engine.generate(prompts[:8], {"temperature": 1.0, "max_new_tokens": NEW_TOKENS, "seed": 4})
        seqs = [p + r for p, r in zip(sampled[C.PROMPT_IDS], sampled[C.RESPONSE_IDS])]
        lens = [len(p) for p in sampled[C.PROMPT_IDS]]
        reference, _ = hf_sequence_stats(hf, seqs, lens)
        result = {"qkv_rows": qkv, "greedy_equal": greedy[C.RESPONSE_IDS] == expected,
                  "sampled": sampled[C.RESPONSE_IDS],
                  "logprob_diff": max(max_abs_diff(sampled["response_logprobs"], reference),
                                      max_abs_diff(engine.logprobs(seqs, lens), reference))}
        engine.load_weights(changed_weights(hf))
        after = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
        result["after_load_equal"] = after[C.RESPONSE_IDS] == hf_greedy(hf, prompts, NEW_TOKENS)
    finally:
        engine.shutdown()  # before the harness tears the group down (vLLM destroys it too)
    return result


@pytest.mark.slow  # 21 s: the default tier's budget
def test_vllm_tensor_parallel_2_matches_hf(tmp_path):
    model_dir = str(trained_tiny_model(tmp_path / "tiny"))
    ranks = run_distributed(_tp_worker, 2, model_dir, timeout=300)
    for r in ranks:
        assert r["qkv_rows"] == (128 + 2 * 64) // 2  # q (4 heads) + k, v (2 heads) of 32, split in 2
        assert r["greedy_equal"] and r["after_load_equal"]
        assert r["logprob_diff"] < 1e-4
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
