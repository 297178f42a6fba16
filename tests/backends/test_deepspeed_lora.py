"""LoRA on the DeepSpeed backend (ZeRO 1, 2 and 3, dp=2) against `peft` on the unsharded model.

One spawn of 2 gloo processes builds a LoRA actor at each stage and runs two train steps (the
first moves B off zero, so the second step's gradients flow through both A and B). The reference
is `peft.get_peft_model` on the single-process Hugging Face model, its A set to the same seeded
start (`xray.backends.lora.initial_a`), trained by `reference_train_step` on the whole batch.
Checked: the step losses, the adapter after two steps, the merged export against peft's
`merge_and_unload`, log-probs with the adapters on (= peft) and off (= the base model), that
the frozen base weights did not move, that only the adapters hold optimizer state, and that
the exported adapter directory loads in `peft` with the same logits. ZeRO-3 trains with activation
checkpointing (transformers' non-reentrant gradient checkpointing: each decoder layer runs twice
per micro-batch), and must still match peft's steps.

Tolerances: adapters within 1e-3 relative to each tensor's largest entry. B starts at zero, so
after two Adam steps every entry of B is about +-2 lr whatever its gradient's size: an entry
whose gradient is near zero turns reduction-order rounding (ZeRO sums over 2 ranks, the
reference over 1) into a visible share of lr (3e-5 measured on an Intel host, 1.0e-4 at
ZeRO-2 on an AMD EPYC host), while a wrong lr, scaling or missed step is off by 0.5 or more.
Merged weights within 1e-5 (B A is small next to W), losses and log-probs within 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_distributed
from xray.backends.base import OptimConfig
from xray.check.reference import hf_logprobs, load_hf, max_rel_diff, policy_loss, random_batch, reference_train_step
from xray.config.lora import PEFT_PREFIX, LoraConfig
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.builtin.tiny_llama import build_tiny_model

pytestmark = pytest.mark.backends

DP, MICRO, STAGES = 2, 2, (1, 2, 3)
RECOMPUTED = 3  # the stage trained with activation checkpointing
OPT = OptimConfig(lr=2e-4, warmup_steps=0)
LORA = LoraConfig(rank=4, alpha=8.0)
SEED = 3


def _np(tensors):
    return {k: v.numpy() for k, v in tensors.items()}


def _torch(arrays):
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _run(rank, world, model_dir, batch, adapter_root):
    from xray.backends.deepspeed import build_engine
    from xray.backends.lora import save_adapter

    part = batch.split(world)[rank]
    results = {}
    for stage in STAGES:
        engine = build_engine(model_dir, ParallelDims(dp=world), "actor", OPT, seed=SEED, zero_stage=stage,
                              lora=LORA, activation_checkpointing=stage == RECOMPUTED)
        calls = [0]  # forwards of the first decoder layer in the two steps
        layer = engine.engine.module.model.layers[0]
        counting = layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        losses = [engine.train_step(part, policy_loss, MICRO)["loss"] for _ in range(2)]
        counting.remove()
        out = {"losses": losses, "layer_calls": calls[0], "on": engine.forward(part)[C.LOGPROBS].numpy(),
               "off": engine.forward(part, adapters=False)[C.LOGPROBS].numpy()}
        merged = {}
        for bucket in engine.export_weights(bucket_bytes=64 << 10):
            merged.update(bucket)
        adapter = engine.export_adapter()
        if engine.exports():
            out["merged"], out["adapter"] = _np(merged), _np(adapter)
            save_adapter(f"{adapter_root}/zero{stage}", adapter, LORA, model_dir)
        inner = engine.optimizer.optimizer  # the torch AdamW under ZeRO's flat partitions
        out["state_numel"] = sum(s["exp_avg"].numel() for s in inner.state.values())
        out["trainable"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.engine.module.parameters()
                               if p.requires_grad)
        results[stage] = out
        del engine
    return results


def _peft_reference(model_dir, batch):
    import peft

    from xray.backends.lora import initial_a

    model = peft.get_peft_model(load_hf(model_dir),
                                peft.LoraConfig(**{k: v for k, v in LORA.peft_config().items() if k != "peft_type"}))
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a = module.lora_A["default"].weight
                a.copy_(initial_a(name.removeprefix(PEFT_PREFIX) + ".weight", a.shape[1], LORA.rank, SEED))
    losses = reference_train_step(model, batch, policy_loss, OPT, MICRO, steps=2)
    return model, losses


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_lora")
    model_dir = build_tiny_model(root / "model", seed=0)
    batch = random_batch(8, 20, 256, seed=1)
    results = run_distributed(_run, DP, str(model_dir), batch, str(root / "adapters"))
    return model_dir, batch, results, root / "adapters"


def test_lora_matches_peft(lora_runs):
    import peft
    from peft.utils import get_peft_model_state_dict

    model_dir, batch, results, adapters = lora_runs
    model, losses = _peft_reference(model_dir, batch)
    ref_adapter = {PEFT_PREFIX + k.removeprefix(PEFT_PREFIX): v for k, v in get_peft_model_state_dict(model).items()}
    ref_on = hf_logprobs(model, batch)
    with model.disable_adapter():
        ref_off = hf_logprobs(model, batch)
    base = load_hf(model_dir)
    base_logprobs = hf_logprobs(base, batch)
    merged_ref = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    for stage, out in ((s, [r[s] for r in results]) for s in STAGES):
        first = out[0]
        assert first["losses"] == pytest.approx(losses, rel=1e-5), stage
        assert first["layer_calls"] == 2 * 8 // DP // MICRO * (2 if stage == RECOMPUTED else 1), stage
        assert max_rel_diff(_torch(first["adapter"]), ref_adapter) < 1e-3, stage
        assert max(float((_torch(first["adapter"])[k]).abs().max()) for k in ref_adapter if "lora_B" in k) > 1e-4
        merged = _torch(first["merged"])
        merged_ref_named = {k: merged_ref[k] for k in merged}
        assert max_rel_diff(merged, merged_ref_named) < 1e-5, stage
        on = torch.cat([torch.from_numpy(o["on"]) for o in out])
        off = torch.cat([torch.from_numpy(o["off"]) for o in out])
        mask = batch[C.ATTENTION_MASK][:, 1:].bool()
        assert float((on - ref_on)[mask].abs().max()) < 1e-5, stage
        assert float((off - ref_off)[mask].abs().max()) < 1e-5, stage
        assert float((off - base_logprobs)[mask].abs().max()) < 1e-5, stage
        assert float((on - off)[mask].abs().max()) > 1e-4, stage  # the adapters do change the model
        adapter_numel = sum(v.numel() for v in ref_adapter.values())
        assert first["trainable"] == adapter_numel
        # Adam state for the adapters only: this rank's partition of them (ZeRO pads to alignment)
        held = sum(o["state_numel"] for o in out)
        assert adapter_numel <= held <= adapter_numel + 64 * DP, (stage, held, adapter_numel)
        # the exported adapter directory loads in plain peft with the same logits
        loaded = peft.PeftModel.from_pretrained(load_hf(model_dir), str(adapters / f"zero{stage}"))
        assert float((hf_logprobs(loaded, batch) - ref_on)[mask].abs().max()) < 1e-5, stage


def test_lora_leaves_base_frozen(lora_runs):
    """The merged export differs from the base only in adapted weights; norms and embeddings are the base's."""
    model_dir, _, results, _ = lora_runs
    base = {k: v for k, v in load_hf(model_dir).state_dict().items()}
    for stage in STAGES:
        merged = _torch(results[0][stage]["merged"])
        for name, tensor in merged.items():
            adapted = name.split(".")[-2] in LORA.targets()
            same = torch.equal(tensor, base[name])
            assert same != adapted, (stage, name)
