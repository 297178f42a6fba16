"""Both rollout engines on the real pretrained model (SmolLM2-135M-Instruct: GQA with 9 query and
3 key-value heads, tied embeddings, its real tokenizer and ChatML template), fp32 on CPU, each run
in the pytest process as inside a rollout Workhorse.

Each engine scores a chat-templated conversation as Hugging Face does, then takes new weights in
place (the embedding, which the tied LM head reads, and one layer's MLP) and scores as Hugging Face
does with the same weights. vLLM on CPU packs each layer's weight for its GEMM when it processes the
layer; its in-place reload writes only the embedding (the head has no checkpoint tensor), so without
the engine processing the head again its logits kept the old embedding (0.28 nat off on a synced
SmolLM2, every exact check passing). The held check now gives the head its own verdict by its
product, and a head left stale fails it.
"""
from __future__ import annotations

import pytest
import torch

from tests.backends.rollout_common import hf_sequence_stats, max_abs_diff
from xray.backends import load_backend

pytestmark = pytest.mark.backends

LOGPROB_TOL = 2e-4  # measured: 5e-5 (vLLM) on 26 tokens of a chat, before and after the reload
CHANGED = ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def real(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    chat = [{"role": "user", "content": "What is 12 times 7? Answer briefly."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + tokenizer.encode("12 times 7 is 84.")
    return hf, [ids], [len(ids) - 8]


def _changed(hf) -> list[tuple[str, torch.Tensor]]:
    """New values for CHANGED, written into `hf` too (a seeded perturbation of 2% of a typical weight)."""
    g = torch.Generator().manual_seed(7)
    params = dict(hf.named_parameters())
    new = []
    with torch.no_grad():
        for name in CHANGED:
            p = params[name]
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * float(p.std()))
            new.append((name, p.detach().clone()))
    return new


@pytest.mark.parametrize("backend", ["vllm", "dsinfer"])
def test_rollout_engine_scores_and_follows_a_reload_of_the_real_model(backend, real, smollm2, monkeypatch):
    hf, seqs, lens = real
    original = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    engine = load_backend(backend).build_engine(smollm2, dtype="float32", seed=0, max_model_len=256)
    try:
        assert max_abs_diff(engine.logprobs(seqs, lens), hf_sequence_stats(hf, seqs, lens)[0]) < LOGPROB_TOL
        new = _changed(hf)
        want = hf_sequence_stats(hf, seqs, lens)[0]
        engine.load_weights(new)
        engine.finish_load()
        assert max_abs_diff(engine.logprobs(seqs, lens), want) < LOGPROB_TOL
        if backend == "vllm":
            held = engine.held_check()
            assert held["mismatched"] == [] and held["unchecked"] == 0
            assert "lm_head.weight" in engine.held_tensors() and "lm_head.weight" in held["checked"]
            # the head left with its old packed weight: its own verdict fails, naming it
            import xray.backends.vllm as vllm_engine

            monkeypatch.setattr(vllm_engine, "refresh_heads", lambda model, heads: None)
            engine.load_weights([(n, original[n]) for n in CHANGED])
            engine.finish_load()
            held = engine.held_check()
            assert len(held["mismatched"]) == 1 and held["mismatched"][0].startswith("lm_head.weight [column ")
    finally:
        hf.load_state_dict(original)
        if hasattr(engine, "shutdown"):  # vLLM's engine holds a process group and threads
            engine.shutdown()


def _train_worker(rank, world_size, backend, model_dir, sequences):
    from xray.backends import load_backend
    from xray.backends.base import OptimConfig
    from xray.config.parallel import ParallelDims
    from xray.data.batch import Batch

    extra = {"zero_stage": 3} if backend == "deepspeed" else {}
    engine = load_backend(backend).build_engine(model_dir, ParallelDims(), "actor", OptimConfig(), seed=0, **extra)
    exported = {n: t.numpy() for bucket in engine.export_weights() for n, t in bucket}
    out = engine.forward(_batch(Batch, sequences))
    return {"exported": exported, "logprobs": {k: v.numpy() for k, v in out.items()}}


def _batch(Batch, sequences):
    from xray.data import columns as C

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return Batch({C.INPUT_IDS: ids, C.ATTENTION_MASK: mask})


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_training_engine_matches_hf_on_the_real_model(backend, real, smollm2):
    """Each training engine's export of the real model is HF's weights bit for bit (the tied head
    not sent twice) and its log-probs of a chat are HF's."""
    from tests.dist_harness import run_distributed
    from xray.check import reference as R
    from xray.data import columns as C
    from xray.data.batch import Batch

    hf, seqs, _ = real
    result = run_distributed(_train_worker, 1, backend, str(smollm2), seqs)[0]
    state = hf.state_dict()
    assert "lm_head.weight" not in result["exported"]  # tied: the embedding is the head
    assert sorted(result["exported"]) == sorted(n for n in state if n != "lm_head.weight")
    assert all(torch.equal(torch.from_numpy(v), state[n]) for n, v in result["exported"].items())
    batch = _batch(Batch, seqs)
    with torch.no_grad():
        want = R.token_logprobs(hf(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK]).logits,
                                batch[C.INPUT_IDS])
    got = torch.from_numpy(result["logprobs"][C.LOGPROBS])
    n = len(seqs[0]) - 1
    assert float((got[0, :n] - want[0, :n]).abs().max()) < LOGPROB_TOL
