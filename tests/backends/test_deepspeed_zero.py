"""DeepSpeed ZeRO stages 1, 2, 3 with dp=2 against the unsharded Hugging Face model.

One spawn (2 gloo processes) builds the three stages one after the other (spawns dominate the
cost: each process imports torch, transformers and DeepSpeed) and, per stage, checks log-probs
and entropy against `xray.check.reference`, one train step against `reference_train_step` (loss,
grad norm, lr, every exported weight), then takes a flash checkpoint at step 1 and runs two more
steps before writing it. A second spawn (fresh processes) loads each stage's checkpoint and must
reproduce those two steps bitwise.
Each stage also checks the critic (values against the unsharded trunk + value head, three steps
lower its loss) and the optimizer-free reference role (stages 1 and 2 run it as stage 0).

Tolerance note: one AdamW step from zero state moves each weight by about lr * g / (|g| + eps),
so an element whose gradient cancels to ~eps turns fp32 rounding of the reduction order into up
to a few percent of lr (reordering the reference's own micro-batches shows the same). Gradients
themselves agree to ~4e-7 relative; the lr below keeps that amplification under the 1e-5
relative bound while a wrong lr, a missed warm-up or a skipped step stays 10x above it.
"""
from __future__ import annotations

import gc

import pytest
import torch

from tests.dist_harness import as_bytes, from_bytes, run_distributed
from xray.backends.base import OptimConfig
from xray.check.reference import (hf_logprobs, load_hf, max_rel_diff, policy_loss, random_batch,
                                  reference_train_step)
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import build_tiny_model

pytestmark = pytest.mark.backends

DP = 2
MICRO = 2
STAGES = (1, 2, 3)
OPT = OptimConfig(lr=2e-5, weight_decay=0.01, grad_clip=0.5, warmup_steps=2)


def _np(tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors cross the process boundary as numpy arrays (torch shares storage by file descriptor)."""
    return {k: v.numpy() for k, v in tensors.items()}


def _torch(arrays: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


BUCKET = 64 << 10  # bytes: the tiny model's 128 KiB embedding stands alone, layers group


def _export(engine, sizes: list | None = None) -> dict:
    """All exported weights; `sizes` collects (tensors, bytes) per bucket."""
    weights = {}
    for bucket in engine.export_weights(bucket_bytes=BUCKET):
        weights.update(bucket)
        if sizes is not None:
            sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
    return _np(weights)


def _value_loss(outputs, batch):
    mask = batch[C.LOSS_MASK]
    loss = ((outputs[C.VALUES] - 1.0) ** 2 * mask).sum() / mask.sum()
    return loss, {}


def _side_roles(rank: int, model_dir: str, stage: int, part) -> dict:
    """Critic values and one critic step; reference-role log-probs (no optimizer)."""
    from xray.backends.deepspeed import build_engine

    out = {}
    critic = build_engine(model_dir, ParallelDims(dp=DP), "critic", OptimConfig(lr=1e-3), seed=7, zero_stage=stage)
    out["values"] = critic.forward(part)[C.VALUES].numpy()
    out["critic_losses"] = [critic.train_step(part, _value_loss, MICRO)["loss"] for _ in range(3)]
    del critic
    ref = build_engine(model_dir, ParallelDims(dp=DP), "reference", OPT, seed=0, zero_stage=stage)
    out["ref_logprobs"] = ref.forward(part)[C.LOGPROBS].numpy()
    out["ref_export"] = _export(ref)  # every rank joins the gathers; rank 1 gets {}
    return out


CORRUPTED = "model.layers.1.mlp.down_proj.weight"
"""The tensor whose exported copy the faulty export changes (one element)."""
DIVERGED = "model.layers.0.self_attn.q_proj.weight"
"""The parameter rank 1 holds otherwise (one element; stages 1 and 2, where ranks are replicas)."""


def _export_faults(engine, rank: int, stage: int) -> dict:
    """The export's digest verdicts with one element of one gathered tensor changed before it is
    yielded, and (stages 1 and 2) with one element of one parameter changed on rank 1 alone."""
    from unittest import mock

    from xray.backends.deepspeed import export

    copy = export._tensor
    names = {id(p): n for n, p in engine.engine.module.named_parameters()}

    def faulty(params, scaling):
        out = copy(params, scaling)
        if names[id(params[0])] == CORRUPTED:
            out.view(-1)[5] += 1.0
        return out

    with mock.patch.object(export, "_tensor", faulty):
        _export(engine)
    out = {"corrupted": engine.export_check()}
    if stage == 3:
        return out
    param = dict(engine.engine.module.named_parameters())[DIVERGED]
    kept = param.detach().view(-1)[7].clone()
    with torch.no_grad():
        if rank == 1:
            param.view(-1)[7] += 1e-3
        _export(engine)
        out["diverged"] = engine.export_check()
        param.view(-1)[7] = kept
    return out


def _train_and_save(rank, world, model_dir, ckpt_root, batches):
    """For each stage in turn: forward, one step, export, save at step 1, two more steps."""
    from xray.backends.deepspeed import build_engine

    part = [b.split(world)[rank] for b in batches]
    results = {}
    for stage in STAGES:
        engine = build_engine(model_dir, ParallelDims(dp=world), "actor", OPT, seed=0, zero_stage=stage)
        fwd = engine.forward(part[0], entropy=True)
        out = {"logprobs": fwd[C.LOGPROBS].numpy(), "entropy": fwd[C.ENTROPY].numpy(),
               "metrics": engine.train_step(part[0], policy_loss, MICRO), "buckets": []}
        out["weights1"] = _export(engine, out["buckets"])
        out["export_check"] = engine.export_check()
        persist = engine.snapshot(f"{ckpt_root}/zero{stage}")  # a flash checkpoint, written late:
        out["losses_after"] = [engine.train_step(p, policy_loss, MICRO)["loss"] for p in part[1:]]
        persist()  # after two more steps, it must still hold step 1
        out["held"] = as_bytes(persist.held())
        out["weights_end"] = _export(engine)
        out["exports"] = engine.exports()
        out.update(_export_faults(engine, rank, stage))
        del engine
        gc.collect()
        out.update(_side_roles(rank, model_dir, stage, part[0]))
        results[stage] = out
    return results


def _load_and_continue(rank, world, model_dir, ckpt_root, batches, held=None):
    """For each stage, in fresh processes: build, load the step-1 checkpoint, run the two steps.
    `held`: every rank's snapshot files per stage; this rank's and rank 0's are read from them."""
    from xray.backends.deepspeed import build_engine

    part = [b.split(world)[rank] for b in batches]
    results = {}
    for stage in STAGES:
        engine = build_engine(model_dir, ParallelDims(dp=world), "actor", OPT, seed=123, zero_stage=stage)
        engine.load(f"{ckpt_root}/zero{stage}", {**from_bytes(held[0][stage]), **from_bytes(held[rank][stage])}
                    if held else None)
        losses = [engine.train_step(p, policy_loss, MICRO)["loss"] for p in part[1:]]
        results[stage] = {"losses_after": losses, "weights_end": _export(engine), "step": engine.step_count}
        del engine
        gc.collect()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    model_dir = str(build_tiny_model(root / "model"))
    batches = [random_batch(8, 16, 256, seed=s) for s in (1, 2, 3)]
    model = load_hf(model_dir)
    with torch.no_grad():
        logits = model(input_ids=batches[0][C.INPUT_IDS], attention_mask=batches[0][C.ATTENTION_MASK],
                       use_cache=False).logits
        ref = {"logprobs": hf_logprobs(model, batches[0]),
               "entropy": -(torch.log_softmax(logits[:, :-1], -1).exp() * torch.log_softmax(logits[:, :-1], -1)).sum(-1),
               "init": {n: p.detach().clone() for n, p in model.named_parameters()}}
    micro = batches[0].chunks(MICRO)
    for mb in micro:  # reference grad norm before clipping
        (policy_loss({C.LOGPROBS: hf_logprobs(model, mb)}, mb)[0] / len(micro)).backward()
    ref["grad_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    ref["loss"] = reference_train_step(model, batches[0], policy_loss, OPT, MICRO)[0]
    ref["weights1"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"root": root, "model_dir": model_dir, "batches": batches, "ref": ref}


@pytest.fixture(scope="module")
def trained(setup):
    """One spawn of DP processes for all three stages: {stage: [rank 0 result, rank 1 result]}."""
    per_rank = run_distributed(_train_and_save, DP, setup["model_dir"], str(setup["root"] / "ckpt"),
                               setup["batches"])
    return {s: [r[s] for r in per_rank] for s in STAGES}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_reference(setup, trained, stage):
    res, ref = trained[stage], setup["ref"]
    logprobs = torch.cat([torch.from_numpy(r["logprobs"]) for r in res])
    entropy = torch.cat([torch.from_numpy(r["entropy"]) for r in res])
    assert (logprobs - ref["logprobs"]).abs().max() <= 1e-4
    assert (entropy - ref["entropy"]).abs().max() <= 1e-4
    m = res[0]["metrics"]
    assert m == res[1]["metrics"]  # metrics are averaged over replicas
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert m["lr"] == pytest.approx(OPT.lr * 0.5, rel=1e-12)  # warm-up step 0 of 2
    assert [r["exports"] for r in res] == [True, False] and not res[1]["weights1"]
    buckets = res[0]["buckets"]
    assert len(buckets) > 3 and all(n == 1 or size <= BUCKET for n, size in buckets)
    assert any(n > 1 for n, _ in buckets) and sum(n for n, _ in buckets) == len(ref["weights1"])
    weights = _torch(res[0]["weights1"])
    assert max_rel_diff(weights, ref["weights1"]) <= 1e-5
    assert max_rel_diff(ref["init"], ref["weights1"]) > 1e-4  # the step moved the weights
    assert res[0]["export_check"] == {"checked": len(ref["weights1"]), "mismatched": [], "diverged": [],
                                      "unchecked": [], "replicas": 1 if stage == 3 else DP}
    assert res[1]["export_check"] is None  # the exporting rank's verdict only


@pytest.mark.parametrize("stage", STAGES)
def test_export_check_catches_a_faulty_gather_and_a_diverged_replica(trained, stage):
    """One element of one exported copy changed fails that tensor alone; on stages 1 and 2 one
    element of one parameter changed on rank 1 names that rank (ZeRO-3 has no replicas: its
    partitions' digests combine into the gathered tensor's instead)."""
    from xray.sync.export_check import check_export
    from xray.transport.errors import WeightSyncError

    corrupted = trained[stage][0]["corrupted"]
    assert corrupted["mismatched"] == [f"{CORRUPTED}: its digest's bit sum, row term, column term differ "
                                       "from its shards'"] and not corrupted["diverged"]
    with pytest.raises(WeightSyncError, match=f"built 1 tensor.*{CORRUPTED}"):
        check_export(1, corrupted)
    if stage == 3:
        return
    diverged = trained[stage][0]["diverged"]
    assert diverged["diverged"] == [f"rank 1 (dp_rank 1) holds {DIVERGED} otherwise than data-parallel replica 0"]
    assert not diverged["mismatched"] and diverged["checked"] == corrupted["checked"] > 10
    with pytest.raises(WeightSyncError, match=f"replicas disagree.*rank 1 \\(dp_rank 1\\) holds {DIVERGED}"):
        check_export(1, diverged)


@pytest.mark.parametrize("stage", STAGES)
def test_critic_and_reference_roles(setup, trained, stage):
    from xray.backends.deepspeed.model import load_model, role_outputs

    res = trained[stage]
    batch = setup["batches"][0]
    with torch.no_grad():
        values = role_outputs(load_model(setup["model_dir"], "critic", seed=7), batch, "critic")[C.VALUES]
    got = torch.cat([torch.from_numpy(r["values"]) for r in res])
    assert got.shape == (8, 15) and values.abs().max() > 1e-3
    assert (got - values).abs().max() <= 1e-5
    losses = res[0]["critic_losses"]
    assert losses[2] < losses[1] < losses[0]
    ref_lp = torch.cat([torch.from_numpy(r["ref_logprobs"]) for r in res])
    assert (ref_lp - setup["ref"]["logprobs"]).abs().max() <= 1e-4
    exported = _torch(res[0]["ref_export"])
    assert max_rel_diff(exported, setup["ref"]["init"]) == 0.0


@pytest.mark.parametrize("source", ["disk", "held"])
def test_resume_is_bitwise_in_fresh_processes(setup, trained, source):
    """From the files on disk, then from the snapshots' files held in memory with the disk's spoiled."""
    runs, held = trained, None
    if source == "held":
        held = [{s: trained[s][rank]["held"] for s in STAGES} for rank in range(DP)]
        for path in (setup["root"] / "ckpt").rglob("*.pt"):
            path.write_bytes(b"spoiled")  # only the held copy can restore now
    resumed = run_distributed(_load_and_continue, DP, setup["model_dir"], str(setup["root"] / "ckpt"),
                              setup["batches"], held)
    for s in STAGES:
        for rank in range(DP):
            assert resumed[rank][s]["step"] == 3
            assert resumed[rank][s]["losses_after"] == runs[s][rank]["losses_after"], f"ZeRO-{s} rank {rank}"
        end, again = _torch(runs[s][0]["weights_end"]), _torch(resumed[0][s]["weights_end"])
        assert sorted(end) == sorted(again)
        assert all(torch.equal(end[k], again[k]) for k in end), f"ZeRO-{s} weights differ after resume"
