"""The vLLM generation engine against Hugging Face, on a trained tiny Llama (fp32, CPU).

One engine for the whole file (starting vLLM costs seconds). It runs in the pytest process, as it
runs inside a rollout Workhorse: vLLM's in-process engine initialises a 1-process gloo group there.
"""
from __future__ import annotations

import pytest
import torch

from tests.backends.rollout_common import (EOS, changed_weights, hf_greedy, hf_sequence_stats, sequences_of,
                                           make_prompts, max_abs_diff, save_symbol_tokenizer, stop_string_case,
                                           trained_tiny_model)
from xray.backends import load_backend
from xray.check.reference import load_hf
from xray.data import columns as C

pytestmark = pytest.mark.backends

NEW_TOKENS = 16
LOGPROB_TOL = 1e-4  # measured: 2.1e-6 greedy, 2.5e-6 sampled (fp32)
MIN_GAP = 1e-3      # measured: 4.8e-3 smallest top-1/top-2 logit gap on the greedy paths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = trained_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny")
    save_symbol_tokenizer(directory)  # for stop strings (it has no EOS: vLLM stops as without it)
    return directory


@pytest.fixture(scope="module")
def hf(model_dir):
    torch.manual_seed(0)
    return load_hf(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = load_backend("vllm").build_engine(model_dir, dtype="float32", seed=0, max_model_len=256,
                                            kv_cache_gib=1, stop_strings=True)
    yield eng
    eng.shutdown()


def test_greedy_equals_hf_generate(engine, hf):
    prompts = make_prompts(16)
    out = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    _, gap = hf_sequence_stats(hf, *sequences_of(out))
    assert gap > MIN_GAP, f"greedy paths have a near-tie (gap {gap:.2e}); the comparison is fragile"
    assert out[C.PROMPT_IDS] == prompts
    assert out[C.RESPONSE_IDS] == expected
    assert out["finish_reason"] == ["length"] * 16
    assert all(len(r) == NEW_TOKENS for r in out[C.RESPONSE_IDS])


def test_logprobs_match_hf_recomputation(engine, hf):
    prompts = make_prompts(8, seed=5)
    out = engine.generate(prompts, {"temperature": 1.0, "max_new_tokens": NEW_TOKENS, "n": 2,
                                    "seed": 3})
    seqs, lens = sequences_of(out)
    reference, _ = hf_sequence_stats(hf, seqs, lens)
    sampled = max_abs_diff(out["response_logprobs"], reference)
    recomputed = max_abs_diff(engine.logprobs(seqs, lens), reference)
    assert sampled < LOGPROB_TOL, sampled
    assert recomputed < LOGPROB_TOL, recomputed
    # raw log-probs, not a sampled-from distribution: a peaked model still has some unlikely picks
    assert min(min(lp) for lp in out["response_logprobs"]) < -0.5


def test_sampling_is_reproducible_with_a_seed(engine):
    prompts = make_prompts(4, seed=9)
    sampling = {"temperature": 1.0, "top_p": 0.95, "top_k": 50, "max_new_tokens": NEW_TOKENS, "n": 3}
    first = engine.generate(prompts, {**sampling, "seed": 11})
    again = engine.generate(prompts, {**sampling, "seed": 11})
    other = engine.generate(prompts, {**sampling, "seed": 12})
    assert first[C.RESPONSE_IDS] == again[C.RESPONSE_IDS]
    assert first["response_logprobs"] == again["response_logprobs"]
    assert first[C.RESPONSE_IDS] != other[C.RESPONSE_IDS]
    assert len(first) == 12 and first[C.PROMPT_IDS] == [p for p in prompts for _ in range(3)]


def test_stop_token_ends_the_response(engine, hf):
    prompt = make_prompts(1, seed=21)[0]
    greedy = hf_greedy(hf, [prompt], NEW_TOKENS)[0]
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    out = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                                     "stop_token_ids": [stop]})
    assert out[C.RESPONSE_IDS][0] == greedy[:cut]
    assert out["finish_reason"] == ["stop"]
    assert len(out["response_logprobs"][0]) == cut
    assert EOS not in greedy  # the stop came from stop_token_ids, not from eos


def test_stop_string_ends_the_response_with_its_token(engine, hf):
    prompt = make_prompts(1, seed=21)[0]
    greedy = hf_greedy(hf, [prompt], NEW_TOKENS)[0]
    stop, cut = stop_string_case(greedy)
    full = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
    out = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "stop": [stop]})
    assert out[C.RESPONSE_IDS][0] == greedy[:cut] and out["finish_reason"] == ["stop"]
    assert out["response_logprobs"][0] == pytest.approx(full["response_logprobs"][0][:cut], abs=1e-6)
    first = greedy.index(greedy[2]) + 1  # a stop token before the stop string ends it first
    early = engine.generate([prompt], {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "stop": [stop],
                                       "stop_token_ids": [greedy[2]]})
    assert early[C.RESPONSE_IDS][0] == greedy[:first] and first < cut


def _long_prompts(count: int, length: int, seed: int = 77) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (count, length), generator=g).tolist()


def test_load_weights_follows_new_weights_and_back(engine, hf):
    # The long prompts fill a whole KV block (128 tokens on CPU), so vLLM's prefix cache holds
    # them from the first call: after new weights it must not serve the stale keys and values.
    prompts = make_prompts(12) + _long_prompts(4, 140)
    engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
    before = hf_greedy(hf, prompts, NEW_TOKENS)
    original = [(k, v.detach().clone()) for k, v in hf.state_dict().items()]
    new = changed_weights(hf)  # trains `hf` further, in place
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    _, gap = hf_sequence_stats(hf, [p + r for p, r in zip(prompts, expected)], [len(p) for p in prompts])
    assert gap > MIN_GAP
    assert sum(a != b for a, b in zip(before, expected)) >= 4  # the new weights do change the output
    try:
        for i in range(0, len(new), 5):  # buckets of 5 tensors split q/k/v and gate/up of a layer
            engine.load_weights(new[i:i + 5])
        assert engine.pending_weights() == []
        out = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
        assert out[C.RESPONSE_IDS] == expected
        seqs, lens = sequences_of(out)
        assert max_abs_diff(engine.logprobs(seqs, lens), hf_sequence_stats(hf, seqs, lens)[0]) < LOGPROB_TOL
    finally:
        engine.load_weights(original)
        hf.load_state_dict(dict(original))
    out = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
    assert out[C.RESPONSE_IDS] == before
