"""Megatron engine vs the single-process Hugging Face reference, for every tp/pp/dp layout and
every architecture it builds (Llama, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms,
Mistral, Qwen3-MoE: its router and experts, and Qwen2-MoE with its gated shared expert, at tp=1,
also with the experts split over two replicas, ep=2: each rank trains its own slice of the batch,
padded to its expert-parallel peer's micro-batch shapes).

One spawn per world size (real processes, real gloo) goes through every layout of that size,
rebuilding Megatron's groups in between (imports dominate a spawn's cost on CPU). Per layout:
export before training (HF -> Megatron -> HF round trip, bitwise), forward (log-probs vs HF), one
train step (loss and gradient norm vs the reference), export after the step (every weight vs
`reference_train_step`). The round trip's export is also written as an HF directory and loaded
back with transformers.
Two variants of the Llama: `llama3_rope`, the same weights with Llama 3's RoPE scaling (original
context 16 positions, the batch's 24: most frequencies are scaled, which moves HF's log-probs by
~1e-2), built by the engine's own inverse frequencies; and `llama_recompute`, the same model
trained with activation checkpointing (Megatron's full recompute; also `qwen3_moe_recompute`),
whose step must equal the plain one (loss, gradient norm, every weight after it) while each decoder
layer runs twice per micro-batch.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

pytestmark = pytest.mark.backends

BATCH, SEQ, MICRO = 8, 24, 2
OPTIM = OptimConfig()  # lr 1e-5, clip 1.0: the defaults a run starts from
SPECS = {"llama": TinySpec(arch="llama"), "qwen2": TinySpec(arch="qwen2", tie_word_embeddings=True),
         "qwen3": TinySpec(arch="qwen3", tie_word_embeddings=True), "mistral": TinySpec(arch="mistral"),
         "qwen3_moe": TinySpec(arch="qwen3_moe"), "qwen2_moe": TinySpec(arch="qwen2_moe"),
         "llama3_rope": TinySpec(arch="llama")}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # below SEQ: the scaling matters
RECOMPUTED = {"llama_recompute": "llama", "qwen3_moe_recompute": "qwen3_moe"}
"""Variants trained with activation checkpointing, and the model (a key of SPECS) each trains."""


def _model_of(arch: str) -> str:
    return RECOMPUTED.get(arch, arch)


def _numpy(tensors):
    # tensors cross the process boundary as numpy: a torch tensor sent through the harness's
    # queue needs its sender alive when the parent reads it
    return {k: v.numpy() for k, v in tensors.items()}


def _torch(arrays):
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _worker(rank, world_size, layouts, faults_dir=None):
    from megatron.core import parallel_state

    results = []
    for model_dir, dims, recompute in layouts:
        results.append(_one_layout(model_dir, dims, recompute))
        parallel_state.destroy_model_parallel()
    if faults_dir is not None:
        results.append(_export_faults(faults_dir))
    return results


CORRUPTED = ("decoder.layers.0.mlp.linear_fc2.weight", "model.layers.0.mlp.down_proj.weight")
"""The entry whose tp shard 1 the faulty gather changes (one element), and its HF name."""
DIVERGED = ("decoder.layers.1.self_attention.linear_proj.weight", "model.layers.1.self_attn.o_proj.weight")
"""The parameter replica 1 holds otherwise (one element), and its HF name."""


def _export_faults(model_dir):
    """The export's digest check against a faulty gather (tp=2: one element of tp shard 1 of one
    entry changed as it reaches the exporting rank) and a diverged replica (dp=2: one element of
    one parameter changed on dp_rank 1); each export's verdict."""
    from unittest import mock

    from megatron.core import parallel_state

    from xray.backends.megatron import build_engine, export

    receive = export._receive_bucket

    def faulty(bucket, *args, **kwargs):
        shards = receive(bucket, *args, **kwargs)
        for i, planned in enumerate(bucket):
            if planned.entry.megatron_name == CORRUPTED[0]:
                shards[i][1].view(-1)[5] += 1.0
        return shards

    engine = build_engine(model_dir, ParallelDims(tp=2), "actor", OPTIM, seed=0)
    with mock.patch.object(export, "_receive_bucket", faulty):
        exported = {n for b in engine.export_weights(bucket_bytes=1 << 16) for n, _ in b}
    out = {"corrupted": engine.export_check(), "corrupted_tensors": len(exported)}
    parallel_state.destroy_model_parallel()
    engine = build_engine(model_dir, ParallelDims(dp=2), "actor", OPTIM, seed=0)
    if engine.shard_info().dp_rank == 1:
        with torch.no_grad():
            dict(engine.model.named_parameters())[DIVERGED[0]].view(-1)[7] += 1e-3
    exported = {n for b in engine.export_weights() for n, _ in b}
    out.update(diverged=engine.export_check(), diverged_tensors=len(exported))
    parallel_state.destroy_model_parallel()
    return out


def _one_layout(model_dir, dims, recompute=False):
    from xray.backends.megatron import EngineUsageError, build_engine

    parallel = ParallelDims(*dims)
    engine = build_engine(model_dir, parallel, "actor", OPTIM, seed=0, activation_checkpointing=recompute)
    before = {n: t for b in engine.export_weights(bucket_bytes=1 << 16) for n, t in b}
    batch = R.random_batch(BATCH, SEQ, SPECS["llama"].vocab_size, seed=1)
    check_before = engine.export_check()
    out = engine.forward(batch, entropy=True)
    info = engine.shard_info()
    calls = [0]  # forwards of this stage's first decoder layer in the train step (recompute: 2 per micro-batch)
    counting = engine.model.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    metrics = engine.train_step(batch.split(parallel.dp)[info.dp_rank], R.policy_loss, MICRO)
    counting.remove()
    after = {n: t for b in engine.export_weights() for n, t in b}
    checks = [check_before, engine.export_check()]
    plain, refused = None, False
    if parallel.world_size == 1:  # the same model with Megatron's own DotProductAttention
        reference_engine = build_engine(model_dir, parallel, "reference", attention="megatron")
        plain = reference_engine.forward(batch)
        try:
            reference_engine.train_step(batch, R.policy_loss, MICRO)
        except EngineUsageError:
            refused = True
    return {"reference_refuses_training": refused, "exports": engine.exports(), "collects": info.collects,
            "metrics": metrics, "layer_calls": calls[0], "export_checks": checks,
            "forward": None if out is None else _numpy(out),
            "forward_megatron_attention": None if plain is None else _numpy(plain),
            "before": _numpy(before), "after": _numpy(after)}


@functools.lru_cache(maxsize=None)
def model_dir(arch: str) -> str:
    import tempfile

    directory = build_tiny_model(tempfile.mkdtemp(prefix=f"xray-mt-{arch}-"), SPECS[arch], seed=0)
    if arch == "llama3_rope":  # the Llama's weights with Llama 3's RoPE: the config alone changes
        config = json.loads((Path(directory) / "config.json").read_text())
        (Path(directory) / "config.json").write_text(json.dumps({**config, "rope_parameters": LLAMA3_ROPE}))
    return str(directory)


@functools.lru_cache(maxsize=None)
def run_world(world_size: int) -> dict:
    """Results of every layout of LAYOUTS with this world size, from one spawn: {(arch, dims): per rank}."""
    mine = [(arch, dims) for arch, dims in LAYOUTS if ParallelDims(*dims).world_size == world_size]
    faults = model_dir("llama") if world_size == 2 else None  # the export check's faults ride along
    per_rank = run_distributed(_worker, world_size, [(model_dir(_model_of(a)), d, a in RECOMPUTED) for a, d in mine],
                               faults)
    out = {key: [r[i] for r in per_rank] for i, key in enumerate(mine)}
    return out if faults is None else {**out, "faults": [r[-1] for r in per_rank]}


def run_layout(arch: str, dims: tuple[int, ...]) -> list[dict]:
    return run_world(ParallelDims(*dims).world_size)[(arch, dims)]


@functools.lru_cache(maxsize=None)
def reference(arch: str) -> dict:
    """HF log-probs, grad norm of the step's gradient, and weights after one reference step."""
    if arch in RECOMPUTED:
        return reference(_model_of(arch))
    batch = R.random_batch(BATCH, SEQ, SPECS[arch].vocab_size, seed=1)
    model = R.load_hf(model_dir(arch))
    with torch.no_grad():
        logits = model(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK]).logits
        logprobs = R.token_logprobs(logits, batch[C.INPUT_IDS])
        logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    micro = batch.chunks(MICRO)
    for mb in micro:
        loss, _ = R.policy_loss({C.LOGPROBS: R.hf_logprobs(model, mb)}, mb)
        (loss / len(micro)).backward()
    grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    losses = R.reference_train_step(model, batch, R.policy_loss, OPTIM, MICRO)
    return {"logprobs": logprobs, "entropy": entropy, "grad_norm": grad_norm, "loss": losses[0],
            "weights": per_expert({k: v.detach().clone() for k, v in model.state_dict().items()})}


def per_expert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each MoE layer's fused experts (transformers 5's state dict) cut into the
    per-expert tensors its checkpoints and the Megatron export name."""
    out = {}
    for name, t in weights.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            for e, rows in enumerate(t):
                gate, up = rows.chunk(2)
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith(".mlp.experts.down_proj"):
            out.update({name.replace("down_proj", f"{e}.down_proj.weight"): rows for e, rows in enumerate(t)})
        else:
            out[name] = t
    return out


LAYOUTS = [("llama", (1, 1, 1)), ("llama", (2, 1, 1)), ("llama", (1, 2, 1)), ("llama", (1, 1, 2)),
           ("llama", (2, 2, 1)), ("qwen2", (2, 1, 1)), ("qwen2", (1, 2, 1)), ("qwen3", (1, 1, 1)),
           ("qwen3", (2, 1, 1)), ("qwen3", (1, 2, 1)), ("mistral", (2, 1, 1)), ("mistral", (1, 2, 1)),
           ("qwen3_moe", (1, 1, 1)), ("qwen3_moe", (1, 2, 1)), ("qwen3_moe", (1, 1, 2)), ("qwen3_moe", (1, 1, 2, 2)),
           ("qwen2_moe", (1, 1, 1)), ("qwen2_moe", (1, 2, 1)), ("qwen2_moe", (1, 1, 2, 2)),
           ("llama3_rope", (1, 1, 1)), ("llama_recompute", (1, 1, 1)), ("llama_recompute", (2, 2, 1)),
           ("qwen3_moe_recompute", (1, 1, 1))]


def _id(arch: str, dims: tuple[int, ...]) -> str:
    return f"{arch}-tp{dims[0]}pp{dims[1]}dp{dims[2]}" + (f"ep{dims[3]}" if len(dims) > 3 else "")


@pytest.mark.parametrize("arch,dims", LAYOUTS, ids=[_id(a, d) for a, d in LAYOUTS])
def test_parity(arch, dims):
    results = run_layout(arch, dims)
    ref = reference(arch)
    collectors = [r for r in results if r["collects"]]
    assert len(collectors) == dims[2]
    for r in collectors:  # every replica saw the whole batch in forward
        diff = (_torch(r["forward"])[C.LOGPROBS] - ref["logprobs"]).abs().max().item()
        assert diff <= 1e-5, f"log-probs differ from HF by {diff}"
        diff = (_torch(r["forward"])[C.ENTROPY] - ref["entropy"]).abs().max().item()
        assert diff <= 1e-4, f"entropy differs from HF by {diff}"
    for r in results:  # metrics agree on every shard and with the reference
        assert r["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert r["metrics"]["lr"] == OPTIM.lr
        if len(dims) == 3:  # (with ep, micro-batches are padded to the expert-parallel peer's count)
            assert r["layer_calls"] == BATCH // dims[2] // MICRO * (2 if arch in RECOMPUTED else 1)
    exporter = [r for r in results if r["exports"]]
    assert len(exporter) == 1 and all(not r["after"] for r in results if not r["exports"])
    after = _torch(exporter[0]["after"])
    expected = {k: v for k, v in ref["weights"].items() if k in after}
    assert R.max_rel_diff(after, expected) <= 1e-5
    moved = R.max_rel_diff(after, _torch(exporter[0]["before"]))
    assert moved > 1e-4, "the step did not change the weights"
    for check in exporter[0]["export_checks"]:  # every tensor exported was checked, and agreed
        assert check == {"checked": len(after), "mismatched": [], "diverged": [], "unchecked": [],
                         "replicas": dims[2]}
    assert all(r["export_checks"] == [None, None] for r in results if not r["exports"])


def test_export_check_catches_a_faulty_gather_and_a_diverged_replica():
    """One element of one tp shard changed on its way to the exporting rank fails that tensor
    alone (its bit sum); one element of one parameter changed on dp_rank 1 names that rank."""
    from xray.sync.export_check import check_export
    from xray.transport.errors import WeightSyncError

    faults = run_world(2)["faults"]
    corrupted, diverged = faults[0]["corrupted"], faults[0]["diverged"]
    assert all(f["corrupted"] is None and f["diverged"] is None for f in faults[1:])  # the exporter's only
    assert corrupted["checked"] == faults[0]["corrupted_tensors"] > 10 and not corrupted["diverged"]
    assert corrupted["mismatched"] == [f"{CORRUPTED[1]}: its digest's bit sum, row term, column term differ "
                                       "from its shards'"]
    with pytest.raises(WeightSyncError, match=f"built 1 tensor.*{CORRUPTED[1]}"):
        check_export(2, corrupted)
    assert diverged["checked"] == faults[0]["diverged_tensors"] and not diverged["mismatched"]
    assert diverged["replicas"] == 2
    assert diverged["diverged"] == [f"rank 1 (dp_rank 1, tp_rank 0) holds {DIVERGED[1]} otherwise than "
                                    "data-parallel replica 0"]
    with pytest.raises(WeightSyncError, match=f"replicas disagree.*rank 1 \\(dp_rank 1.*{DIVERGED[1]}"):
        check_export(2, diverged)


@pytest.mark.parametrize("arch,dims", [("llama", (1, 1, 1)), ("llama", (2, 2, 1)), ("qwen3_moe", (1, 1, 1))],
                         ids=["llama-tp1pp1", "llama-tp2pp2", "qwen3_moe-tp1pp1"])
def test_activation_checkpointing_takes_the_same_step(arch, dims):
    plain, recomputed = run_layout(arch, dims), run_layout(f"{arch}_recompute", dims)
    for p, r in zip(plain, recomputed):  # rank by rank
        assert r["metrics"]["loss"] == pytest.approx(p["metrics"]["loss"], rel=1e-6, abs=1e-7)
        assert r["metrics"]["grad_norm"] == pytest.approx(p["metrics"]["grad_norm"], rel=1e-6)
        assert r["layer_calls"] == 2 * p["layer_calls"] > 0  # each layer ran again in the backward
    after = [_torch(r["after"]) for r in (*plain, *recomputed) if r["exports"]]
    assert len(after) == 2 and R.max_rel_diff(after[1], after[0]) <= 1e-6


def test_llama3_rope_scaling_changes_the_model():
    """`llama3_rope`'s parity is not plain RoPE's by accident: the scaling moves HF's log-probs
    1000 times the parity bound."""
    gap = (reference("llama3_rope")["logprobs"] - reference("llama")["logprobs"]).abs().max().item()
    assert gap > 1e-3


def test_megatron_core_attention_matches_hf():
    """The engine's default core attention is torch SDPA; Megatron's DotProductAttention agrees.
    (That engine is a reference: it must refuse to train.)"""
    result = run_layout("llama", (1, 1, 1))[0]
    assert result["reference_refuses_training"]
    plain = result["forward_megatron_attention"]
    assert (_torch(plain)[C.LOGPROBS] - reference("llama")["logprobs"]).abs().max().item() <= 1e-4
    assert C.ENTROPY not in plain  # a forward returns entropy only when asked


@pytest.mark.parametrize("arch,dims", [("llama", (2, 2, 1)), ("qwen2", (2, 1, 1)), ("qwen2", (1, 2, 1)),
                                       ("qwen3", (2, 1, 1)), ("qwen3", (1, 2, 1)), ("mistral", (2, 1, 1)),
                                       ("qwen3_moe", (1, 2, 1)), ("qwen3_moe", (1, 1, 2, 2))])
def test_round_trip_is_bitwise(arch, dims):
    from xray.backends.megatron.hf_weights import HFWeights

    exported = _torch([r for r in run_layout(arch, dims) if r["exports"]][0]["before"])
    original = HFWeights(model_dir(arch))
    assert sorted(exported) == original.names()
    for name in original.names():
        assert torch.equal(exported[name], original.get(name)), name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # tied embeddings with q/k/v biases; with q/k norms
def test_export_loads_in_transformers(tmp_path, arch):
    import shutil

    from safetensors.torch import save_file

    dims = (2, 1, 1)
    exported = _torch([r for r in run_layout(arch, dims) if r["exports"]][0]["before"])
    save_file({k: v.contiguous() for k, v in exported.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{model_dir(arch)}/config.json", tmp_path / "config.json")
    ids = R.random_batch(2, 12, SPECS[arch].vocab_size, seed=3)[C.INPUT_IDS]
    with torch.no_grad():
        reloaded = R.load_hf(str(tmp_path))(input_ids=ids).logits
        original = R.load_hf(model_dir(arch))(input_ids=ids).logits
    assert torch.equal(reloaded, original)
