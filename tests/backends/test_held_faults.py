"""Each way an engine can end up holding other weights than it was sent is caught by the held
check, on vLLM and DeepSpeed-Inference, fp32 and bf16: a square weight held transposed, two rows
exchanged, another layer's weight, the previous version's (a tensor the reload skipped), a tensor
never sent (the completeness check: the engine's needs against what it loaded). vLLM on CPU keeps
its linear layers only packed for oneDNN, so there these faults are seen by the functional check
(its own layer's product); everything else bit for bit. Nothing is left unchecked.

One engine per (backend, dtype), in the pytest process as in a rollout Workhorse. The wrong
tensor-parallel slice is in tests/backends/test_dsinfer_engine.py (it needs 2 ranks); the
checksum and the manifest in tests/unit/test_sync_faults.py; through the runtime, with the probe,
in tests/ray/test_weight_sync.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.backends.rollout_common import changed_weights, trained_tiny_model
from xray.backends import load_backend
from xray.builtin.tiny_llama import TinySpec, build_tiny_model
from xray.check.reference import load_hf
from xray.sync.manifest import incomplete
from xray.transport.wire import manifest_of

pytestmark = pytest.mark.backends

HOLDS = {"vllm": 15, "dsinfer": 21}
"""What a replica of the 2-layer tiny Llama holds (vLLM fuses q/k/v and gate/up)."""
SQUARE = "model.layers.0.self_attn.o_proj.weight"
ROWS = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trained_tiny_model(tmp_path_factory.mktemp("held") / "tiny")


@pytest.fixture(scope="module", params=[("vllm", "float32"), ("vllm", "bfloat16"), ("dsinfer", "float32"),
                                        ("dsinfer", "bfloat16")], ids=lambda p: "-".join(p))
def engine(request, model_dir):
    backend, dtype = request.param
    eng = load_backend(backend).build_engine(model_dir, dtype=dtype, seed=0, max_model_len=256)
    eng.backend = backend
    yield eng
    eng.shutdown() if hasattr(eng, "shutdown") else None


def hold(engine, name: str, wrong: torch.Tensor, sent: torch.Tensor) -> dict:
    """Make the engine hold `wrong` for `name` while it was sent `sent`; its held check."""
    if engine.backend == "vllm":
        engine.reload([(name, wrong)])
        engine._check_held([(name, sent)])
    else:
        with torch.no_grad():
            engine.params[name].copy_(wrong)
        engine._check_held([(name, sent)])
    return engine.held_check()


def test_an_engine_holding_other_weights_than_sent_is_caught(engine, model_dir):
    old = dict(load_hf(str(model_dir)).state_dict())
    new = changed_weights(load_hf(str(model_dir)))
    engine.load_weights(new)
    report = engine.held_check()
    assert report["mismatched"] == [] and report["unchecked"] == 0, report
    assert report["exact"] + report["functional"] == HOLDS[engine.backend], report
    loaded = {"loaded": [n for n, _ in new], "names": engine.weight_names(), "waiting": engine.pending_weights()}
    assert incomplete(manifest_of(new), loaded) == []  # the export's names are the engine's

    sent = dict(new)
    faults = {"transposed": (SQUARE, sent[SQUARE].t()),
              "rows exchanged": (ROWS, sent[ROWS][[1, 0, *range(2, sent[ROWS].shape[0])]]),
              "another layer's": (SQUARE, sent["model.layers.1.self_attn.o_proj.weight"]),
              "the previous version's": (ROWS, old[ROWS])}
    for what, (name, wrong) in faults.items():
        report = hold(engine, name, wrong, sent[name])
        assert len(report["mismatched"]) == 1 and report["mismatched"][0].startswith(name), (what, report)
        assert "held otherwise than sent" in report["mismatched"][0], (what, report)
    engine.load_weights(new)  # back to what was sent
    assert engine.held_check()["mismatched"] == []

    unsent = [(n, t) for n, t in new if n != "model.layers.0.self_attn.q_proj.weight"]
    engine.not_reloaded()  # what the reloads before this sync missed
    engine.load_weights(unsent)
    assert engine.held_check()["mismatched"] == []  # what it holds of what it was sent is right
    loaded = {"loaded": [n for n, _ in unsent], "names": engine.weight_names(), "waiting": engine.pending_weights(),
              "not_reloaded": engine.not_reloaded()}  # vLLM's own account: q/k/v of layer 0 never written
    problems = incomplete(manifest_of(unsent), loaded)
    assert problems[0] == "1 tensor(s) the engine needs were not sent (model.layers.0.self_attn.q_proj.weight)"
    if engine.backend == "vllm":  # k and v of that layer wait for q: never reloaded
        assert problems[1:] == ["1 engine parameter(s) no reload of this sync wrote (vLLM's own account) "
                                "(model.layers.0.self_attn.qkv_proj.weight)",
                                "2 tensor(s) held back, never reloaded (their fused layer is incomplete) "
                                "(model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight)"], problems
    engine.drop_pending()  # the end of that (failed) sync
    engine.load_weights(new)
    assert engine.pending_weights() == [] and engine.held_check()["mismatched"] == []


WIDE = TinySpec(vocab_size=256, hidden_size=2048, intermediate_size=2048, num_layers=1, num_heads=16, num_kv_heads=4)
"""One layer at a real width (2048): what a one-step-stale weight is checked at."""


@pytest.mark.parametrize("backend, dtype", [("vllm", "float32"), ("vllm", "bfloat16"), ("dsinfer", "float32"),
                                            ("dsinfer", "bfloat16")])
def test_a_weight_one_optimizer_step_stale_at_width_2048_is_named(tmp_path, backend, dtype):
    """The engine holds one weight as it was one optimizer step before (lr 1e-5, Adam's first step:
    every element moved by the learning rate; in bf16 the step flips the rounding of some elements
    only) while the sync sent the new one: the held check names that tensor, and only it (vLLM: its
    layer's seeded columns read back through the kernel; DeepSpeed-Inference: bit for bit)."""
    from safetensors.torch import load_file

    directory = build_tiny_model(tmp_path / "wide", WIDE, seed=0)
    sent = {n: t.to(getattr(torch, dtype)) for n, t in load_file(directory / "model.safetensors").items()}
    name = "model.layers.0.self_attn.o_proj.weight"
    fp32 = load_file(directory / "model.safetensors")[name]
    stale = (fp32 - 1e-5 * torch.sign(torch.randn(fp32.shape, generator=torch.Generator().manual_seed(0))))
    stale = stale.to(getattr(torch, dtype))
    assert not torch.equal(stale, sent[name])
    engine = load_backend(backend).build_engine(directory, dtype=dtype, seed=0, max_model_len=256)
    engine.backend = backend
    try:
        engine.load_weights(list(sent.items()))
        report = engine.held_check()
        assert report["mismatched"] == [] and report["unchecked"] == 0, report
        report = hold(engine, name, stale, sent[name])
        assert len(report["mismatched"]) == 1 and report["mismatched"][0].startswith(name), report
        assert "held otherwise than sent" in report["mismatched"][0], report
    finally:
        engine.shutdown() if hasattr(engine, "shutdown") else None
