"""Three-step LoRA PPO on megatron-vllm (issue 19): adapters train, the rollout takes the adapters
alone and is verified every step, and no reference model starts. The deepspeed-dsinfer pair's
LoRA PPO run is the PPO run of tests/e2e/test_rm_e2e.py (its actor trains adapters and its rollout
takes merged weights, with a trained reward model scoring): both are checked by `check_lora_run`.

Layout as the PPO e2e (actor and critic on Megatron tp=2, a vLLM rollout of 2 replicas), with
`actor.lora` (rank 4, all-linear) and the reference still named in the device group: the plan
leaves it out. The adapters alone reach vLLM's LoRA slot: each step's exact check covers exactly
the adapter tensors (A and B of every adapted layer, on each replica) and the log-prob probe stays
within the fp32 bound the tests expect (`FP32_PROBE`). The KL to the reference comes from the actor with its adapters off
(zero before the first update, not after), and the run exports a `peft` adapter directory that
loads on the base model in peft and changes its logits.
"""
import asyncio
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.e2e.test_ppo_e2e import FP32_PROBE, config
from algorithms.specs import command_spec

pytestmark = pytest.mark.e2e
LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
ADAPTER_TENSORS = 2 * 7 * 2  # the tiny model: layers x all-linear modules x (A, B)
MODEL_TENSORS = 21  # the tiny model's tensors, all synced when merged


def with_lora(path: Path) -> None:
    """Turn the PPO config at `path` into a LoRA run (a learning rate for adapters)."""
    raw = yaml.safe_load(path.read_text())
    raw["actor"]["lora"] = dict(LORA)
    raw["actor"]["optim"] = {**raw["actor"].get("optim", {}), "lr": 1e-3}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def check_lora_run(run: Path, model_dir: Path, adapters_alone: bool, replicas: int = 2) -> None:
    """A 3-step LoRA PPO run: every sync verified (the adapters alone, or merged weights), KL from
    the actor with its adapters off, a peft adapter directory that loads and matters."""
    import peft

    from xray.check.reference import load_hf

    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        assert row.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE and row["sync/version"] == row["step"], row
        assert row["sync/held_exact"] == replicas * (ADAPTER_TENSORS if adapters_alone else MODEL_TENSORS)
    assert rows[1]["kl"] == 0.0  # before any update the actor is its base: the reference
    assert rows[3]["kl"] != 0.0
    adapter = run / "final/adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["rank"]
    assert not (run / "final/actor").exists()  # merged only on actor.lora.export_merged
    model = peft.PeftModel.from_pretrained(load_hf(str(model_dir)), str(adapter))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.isfinite(tuned).all() and float((tuned - base).abs().max()) > 0


def test_lora_ppo_three_steps_megatron_vllm(tmp_path, tiny_model):
    from algorithms.rl import rl_trainer
    from xray.run.loop import train
    from xray.config import load_config
    from xray.config.plan import plan_run
    from xray.run.outputs import RunDir

    path = config(tmp_path, tiny_model, "megatron-vllm")
    with_lora(path)
    cfg = load_config(path)
    plan = plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert [r.role for r in plan.roles] == ["rollout", "actor", "critic"] and plan.lora_sync == "adapters"
    assert "no reference model starts" in plan.describe()
    run = RunDir(tmp_path / "run")
    with rl_trainer(cfg, plan, run) as (trainer, data):
        assert trainer.models.reference is None
        asyncio.run(train(trainer, run, data, None))
    run.close()
    check_lora_run(tmp_path / "run", tiny_model, adapters_alone=True)
