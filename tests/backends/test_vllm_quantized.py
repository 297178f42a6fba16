"""A quantized vLLM engine (`quantization="fp8"`: vLLM's `fp8_per_channel` on CPU, bf16 activations)
on a trained tiny Llama: after an in-place reload it holds exactly our quantization of the new
weights, and the held check catches an engine that holds anything else.

One engine for the whole file (starting vLLM costs seconds), in the pytest process as in a rollout
Workhorse.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.backends.rollout_common import (changed_weights, hf_sequence_stats, make_prompts, sequences_of,
                                           trained_tiny_model)
from xray.backends import load_backend
from xray.backends.quantize import fp8_per_channel
from xray.backends.vllm import VllmEngineError
from xray.check.reference import load_hf
from xray.config.schema import SyncConfig
from xray.sync import WeightSyncError
from xray.sync.weights import check_exact, probe_bound

pytestmark = pytest.mark.backends

NEW_TOKENS = 12
HELD = 15  # embedding, lm_head, 5 norms in bf16; 2 x (qkv, o, gate_up, down) in fp8
TARGET = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained_tiny_model(tmp_path_factory.mktemp("fp8") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = load_backend("vllm").build_engine(model_dir, dtype="bfloat16", seed=0, max_model_len=256,
                                            kv_cache_gib=1, quantization="fp8")
    yield eng
    eng.shutdown()


def test_fp8_needs_a_bf16_engine_and_int8_is_refused(model_dir):
    with pytest.raises(VllmEngineError, match="dtype='bfloat16'"):
        load_backend("vllm").build_engine(model_dir, dtype="float32", quantization="fp8")
    with pytest.raises(VllmEngineError, match="this device offers: none, fp8"):
        load_backend("vllm").build_engine(model_dir, dtype="bfloat16", quantization="int8")


def test_reload_holds_the_quantized_new_weights(engine, model_dir):
    prompts = make_prompts(12)
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    before = engine.generate(prompts, greedy)
    hf = load_hf(str(model_dir))
    new = changed_weights(hf)  # the actor trained on (fp32, as an fp32 actor sends them)
    held = []
    for cast in (torch.float32, torch.bfloat16):  # an fp32 actor, then a bf16 one
        t0 = time.perf_counter()
        for i in range(0, len(new), 5):  # buckets of 5 split q/k/v and gate/up of a layer
            engine.load_weights([(k, v.to(cast)) for k, v in new[i:i + 5]])
        held.append((engine.held_check(), time.perf_counter() - t0))
        assert engine.pending_weights() == [] and sorted(engine.held_tensors()) == sorted(held[-1][0]["checked"])
    for report, _ in held:  # every tensor compared, the fp8 layers code for code
        report = {k: v for k, v in report.items() if k != "checked"}
        assert report == {"exact": HELD, "functional": 0, "unchecked": 0, "mismatched": []}, report
    out = engine.generate(prompts, greedy)
    assert sum(a != b for a, b in zip(out["response_ids"], before["response_ids"])) >= 4  # the new weights act
    seqs, lens = sequences_of(out)
    reference, _ = hf_sequence_stats(hf, seqs, lens)  # fp32, the new weights
    gaps = torch.tensor([abs(a - b) for xs, ys in zip(engine.logprobs(seqs, lens), reference) for a, b in zip(xs, ys)])
    # quantized by design, yet the same model: measured mean 0.009, max 0.20 on these greedy paths
    assert 0.0 < float(gaps.mean()) < 0.1, gaps
    gap = {"rollout_logprob_gap_mean": float(gaps.mean()), "rollout_logprob_gap_max": float(gaps.max())}
    assert probe_bound(SyncConfig(), ["bfloat16"], quantized=True).holds(gap)


def _faulty(engine, monkeypatch, change):
    """Make the engine's reload load `change(tensor)` for TARGET instead of what it was sent."""
    reload = engine.reload

    def faulty_reload(tensors):
        return reload([(n, change(t) if n == TARGET else t) for n, t in tensors])

    monkeypatch.setattr(engine, "reload", faulty_reload)


def _one_fp8_step(weight: torch.Tensor) -> torch.Tensor:
    """`weight` with one element of row 0 moved to the next fp8 code up: the smallest change the
    engine's fp8 form can show (a positive code in [0.5, 32), far below the row's largest, 448,
    so the row's scale stays)."""
    codes, scale = fp8_per_channel(weight, torch.bfloat16)
    row = codes[0].view(torch.uint8)
    col = int(((row > 0x30) & (row < 0x60)).nonzero()[0])  # e4m3 bytes: exponent field 6 to 11
    following = (row[col] + 1).view(torch.float8_e4m3fn).float()
    changed = weight.clone()
    changed[0, col] = float(following) * float(scale[0, 0])
    return changed


@pytest.mark.parametrize("change", ["whole tensor +1e-2", "one element, one fp8 step"])
def test_held_check_catches_a_perturbed_tensor(engine, model_dir, monkeypatch, change):
    new = changed_weights(load_hf(str(model_dir)), seed=2)
    _faulty(engine, monkeypatch, (lambda t: t + 1e-2) if change.startswith("whole") else _one_fp8_step)
    engine.load_weights(new)
    report = engine.held_check()
    assert report["exact"] == HELD - 1 and len(report["mismatched"]) == 1, report
    assert report["mismatched"][0].startswith(f"{TARGET} [fp8: "), report
    if change.startswith("one"):
        assert report["mismatched"][0].startswith(f"{TARGET} [fp8: 1/32768 codes"), report
    with pytest.raises(WeightSyncError, match=f"version 7 failed verification.*{TARGET}"):
        check_exact(7, [{"held": report, "dtype": "bfloat16", "quantization": "fp8"}])
    monkeypatch.undo()
    engine.load_weights(new)
    assert engine.held_check()["mismatched"] == []
