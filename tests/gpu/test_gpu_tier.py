"""The GPU tier: the training backends and the plain Workhorses on CUDA, bf16, without Ray.

The lent GPU machine has PyTorch, transformers and NCCL but no Ray or vLLM (see FACTS.md), so this
is the backend tier of `tests/backends` on a GPU: engines in local processes joined by NCCL (a world
of one), `tests/gpu/run_on_device.sh` installs the carried Megatron-core and DeepSpeed wheels and
runs it. Skipped without CUDA. `XRAY_GPU_TIER_DEVICE=cpu` runs the same tests on the CPU (gloo,
with the CPU adaptations): a check of the tests themselves, not of a GPU.

Per engine (Megatron, world of 1; DeepSpeed ZeRO-3, world of 1), both in bf16 (`model.dtype`), on
Llama, and on Qwen3 (Megatron) and Qwen3-MoE (both):
log-probs against the single-process Hugging Face bf16 model, one optimizer step (loss and
gradient norm against the Hugging Face model's), the export under Hugging Face names, and a
checkpoint round trip (a fresh engine loaded from it takes the next step exactly as the saved
one does), and the algorithms' `PolicyLoss` in length-grouped, trimmed micro-batches taking the
step of one whole micro-batch. Then the Megatron critic head, the HF reference Workhorse and the reward Workhorse on
the device, and a 20-step PPO-style loop (clipped ratio loss on fixed advantages) on the Megatron
engine that must lower its loss. On CUDA the CPU adaptations of Megatron must stay off.
"""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check import reference as R
from xray.data import columns as C
from xray.builtin.tiny_llama import TinySpec, build_tiny_model

DEVICE = os.environ.get("XRAY_GPU_TIER_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or XRAY_GPU_TIER_DEVICE=cpu)")]
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"
SPEC = TinySpec(arch="llama")
SPECS = {"llama": SPEC, "qwen3": TinySpec(arch="qwen3"), "qwen3_moe": TinySpec(arch="qwen3_moe")}
BATCH, SEQ, MICRO = 8, 24, 4
OPTIM = OptimConfig(lr=1e-3)


@functools.lru_cache(maxsize=None)
def model_dir(arch: str = "llama") -> str:
    return str(build_tiny_model(tempfile.mkdtemp(prefix="xray-gpu-"), SPECS[arch], seed=0))


def _batch():
    return R.random_batch(BATCH, SEQ, SPEC.vocab_size, seed=1)


def _engine(backend: str, directory: str, role: str = "actor"):
    from xray.config.parallel import ParallelDims

    if backend == "megatron":
        from xray.backends.megatron import build_engine

        return build_engine(directory, ParallelDims(), role, OPTIM, seed=0, device=DEVICE, dtype="bfloat16")
    from xray.backends.deepspeed import build_engine

    return build_engine(directory, ParallelDims(), role, OPTIM, 0, 3, device=DEVICE, dtype="bfloat16")


def _engine_round_trip(rank, world, backend, directory, checkpoint):
    from xray.backends import cpu_compat

    batch = _batch()
    engine = _engine(backend, directory)
    logprobs = engine.forward(batch)[C.LOGPROBS]
    first = engine.train_step(batch, R.policy_loss, MICRO)
    exported = {n: (str(t.dtype), tuple(t.shape)) for b in engine.export_weights() for n, t in b}
    engine.save(checkpoint)
    fresh = _engine(backend, directory)
    fresh.load(checkpoint)
    nxt, resumed = engine.train_step(batch, R.policy_loss, MICRO), fresh.train_step(batch, R.policy_loss, MICRO)
    return {"logprobs": logprobs.float().numpy(), "first": first, "next": nxt, "resumed": resumed,
            "exported": exported, "cpu_compat": cpu_compat._APPLIED}


@functools.lru_cache(maxsize=None)
def hf_reference(arch: str = "llama") -> dict:
    """The Hugging Face bf16 model on the device: log-probs, the fp32 model's, first loss and grad norm."""
    from transformers import AutoModelForCausalLM

    batch = _batch()
    with torch.no_grad():
        fp32 = R.hf_logprobs(R.load_hf(model_dir(arch)), batch)
    model = AutoModelForCausalLM.from_pretrained(model_dir(arch), dtype=torch.bfloat16).to(DEVICE)
    on_device = batch.to(DEVICE)
    with torch.no_grad():
        bf16 = R.hf_logprobs(model, on_device).float().cpu()
    micro = on_device.chunks(MICRO)
    loss_sum = 0.0
    for mb in micro:
        loss, _ = R.policy_loss({C.LOGPROBS: R.hf_logprobs(model, mb)}, mb)
        (loss / len(micro)).backward()
        loss_sum += float(loss) / len(micro)
    norm = float(torch.nn.utils.get_total_norm([p.grad.float() for p in model.parameters()]))
    names = {n: (str(p.dtype), tuple(p.shape)) for n, p in model.named_parameters()}
    return {"fp32": fp32, "bf16": bf16, "loss": loss_sum, "grad_norm": norm, "names": names}


@pytest.mark.parametrize("backend,arch", [("megatron", "llama"), ("deepspeed", "llama"), ("megatron", "qwen3"),
                                          ("megatron", "qwen3_moe"), ("deepspeed", "qwen3_moe")])
def test_engine_in_bf16_matches_hf_and_resumes_exactly(backend, arch, tmp_path):
    r, = run_distributed(_engine_round_trip, 1, backend, model_dir(arch), str(tmp_path / "ckpt"), backend=BACKEND)
    ref = hf_reference(arch)
    mask = _batch()[C.ATTENTION_MASK][:, 1:].bool()
    gap = float((ref["bf16"] - ref["fp32"])[mask].abs().max())
    diff = float((torch.from_numpy(r["logprobs"]) - ref["bf16"])[mask].abs().max())
    assert diff <= max(0.02, 2 * gap), (diff, gap)
    assert r["first"]["loss"] == pytest.approx(ref["loss"], abs=2e-2)
    assert r["first"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)
    names = ref["names"] if backend == "deepspeed" else per_expert_names(ref["names"])  # Megatron: experts one by one
    assert r["exported"] == names  # every tensor, under its HF name, in bf16
    assert r["next"] == r["resumed"]  # the checkpoint holds everything the next step reads
    assert r["cpu_compat"] == (DEVICE == "cpu" and backend == "megatron")


def per_expert_names(names: dict[str, tuple]) -> dict[str, tuple]:
    """(dtype, shape) by name with a mixture of experts' fused experts cut into per-expert tensors."""
    from tests.backends.test_megatron_parity import per_expert

    meta = {n: torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device="meta")
            for n, (dtype, shape) in names.items()}
    return {n: (str(t.dtype), tuple(t.shape)) for n, t in per_expert(meta).items()}


def _grouped_steps(rank, world, backend, directory):
    from algorithms.core.policy_loss import PolicyLoss

    from tests.backends.test_length_grouped_steps import _batch as ragged_batch

    batch, out = ragged_batch(), {}
    for micro in (2, len(batch)):  # length-grouped and trimmed micro-batches, then one whole micro-batch
        out[micro] = _engine(backend, directory).train_step(batch, PolicyLoss(on_policy=True), micro)
    return {k: (v["loss"], v["grad_norm"]) for k, v in out.items()}


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_length_grouped_micro_batches_on_the_device(backend):
    """The algorithms' loss (`PolicyLoss`, slice-wide denominators) in micro-batches of 2, grouped by
    length and cut to their longest row on the host before they move to the device, takes the step
    of one whole micro-batch (bf16: 1% on the loss, 3% on the gradient norm)."""
    r, = run_distributed(_grouped_steps, 1, backend, model_dir(), backend=BACKEND)
    (loss, norm), (whole_loss, whole_norm) = r[2], r[8]
    assert whole_norm > 0 and abs(whole_loss) > 1e-4
    assert loss == pytest.approx(whole_loss, rel=1e-2, abs=1e-4)
    assert norm == pytest.approx(whole_norm, rel=3e-2)


def _critic_and_loop(rank, world, directory):
    batch = _batch()
    critic = _engine("megatron", directory, "critic")
    values = critic.forward(batch)[C.VALUES]
    target = torch.linspace(-1, 1, values.shape[1]).expand_as(values)

    def value_loss(outputs, mb):
        return (outputs[C.VALUES] - target[: len(mb)].to(outputs[C.VALUES].device)).pow(2).mean()

    value_losses = [critic.train_step(batch, value_loss, MICRO)["loss"] for _ in range(5)]
    actor = _engine("megatron", directory)
    old = actor.forward(batch)[C.LOGPROBS]
    advantages = torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    batch[C.OLD_LOGPROBS], batch[C.ADVANTAGES] = old, advantages

    def ppo_loss(outputs, mb):
        mask = mb[C.LOSS_MASK]
        ratio = (outputs[C.LOGPROBS] - mb[C.OLD_LOGPROBS]).exp()
        adv = mb[C.ADVANTAGES]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return -(surrogate * mask).sum() / mask.sum()

    losses = [actor.train_step(batch, ppo_loss, MICRO)["loss"] for _ in range(20)]
    return {"values_shape": tuple(values.shape), "values_finite": bool(torch.isfinite(values).all()),
            "value_losses": value_losses, "ppo_losses": losses}


def test_critic_head_and_a_ppo_style_loop_learn():
    r, = run_distributed(_critic_and_loop, 1, model_dir(), backend=BACKEND)
    assert r["values_shape"] == (BATCH, SEQ - 1) and r["values_finite"]
    assert r["value_losses"][-1] < 0.5 * r["value_losses"][0], r["value_losses"]
    assert r["ppo_losses"][-1] < r["ppo_losses"][0] - 0.05, r["ppo_losses"]


def test_reference_and_reward_workhorses_on_the_device(tmp_path):
    """The plain HF reference Workhorse and the reward Workhorse, built as a WholeModel builds them
    (no Ray here: the objects themselves), give the Hugging Face model's answers on the device."""
    from transformers import AutoModelForSequenceClassification

    from xray.config.parallel import ParallelDims
    from xray.workhorse.hf import HFWorkhorse
    from xray.workhorse.reward import RewardWorkhorse

    device = "gpu" if DEVICE == "cuda" else "cpu"
    batch = _batch()
    reference = HFWorkhorse("reference", 0, ParallelDims(), device=device, model_dir=model_dir())
    reference.setup()
    assert reference.model_device.type == DEVICE
    expected = R.hf_logprobs(R.load_hf(model_dir()), batch)
    got = reference.forward(batch)[C.LOGPROBS]
    assert got.device.type == "cpu" and float((got - expected).abs().max()) <= 2e-3

    reward_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(model_dir(), num_labels=1, pad_token_id=0).save_pretrained(reward_dir)
    reward = RewardWorkhorse("reward", 0, ParallelDims(), device=device, model_dir=str(reward_dir))
    reward.setup()
    scores = reward.score(batch)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK]).logits[:, 0]
    assert scores.device.type == "cpu" and float((scores.float() - logits).abs().max()) <= 2e-3
