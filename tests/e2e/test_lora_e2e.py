"""Three-step LoRA PPO runs on both backend pairs (issue 19): adapters train, the rollout is synced
and verified every step, and no reference model starts.

Layout as the PPO e2e (actor and critic on Megatron tp=2 or DeepSpeed ZeRO-3 dp=2, a rollout of 2
replicas), with `actor.lora` (rank 4, all-linear) and the reference still named in the device
group: the plan leaves it out. megatron-vllm syncs the adapters alone into vLLM's LoRA slot: each
step's exact check then covers exactly the adapter tensors (A and B of every adapted layer, on
each replica) and the log-prob probe stays within the fp32 tolerance. deepspeed-dsinfer syncs
merged weights. Both: the KL to the reference comes from the actor with its adapters off (zero
before the first update, not after), and the run exports a `peft` adapter directory that loads
on the base model in peft.
"""
import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_ppo_e2e import config

pytestmark = pytest.mark.e2e
RANK = 4


@pytest.mark.parametrize("backend", ["megatron-vllm", "deepspeed-dsinfer"])
def test_lora_ppo_three_steps(tmp_path, tiny_model, backend):
    import peft
    import yaml

    from algorithms.ppo.run import ppo_trainer, train
    from xray.check.reference import load_hf
    from xray.config import load_config
    from xray.config.plan import plan_run
    from xray.run.outputs import RunDir

    path = config(tmp_path, tiny_model, backend)
    raw = yaml.safe_load(path.read_text())
    raw["actor"]["lora"] = {"rank": RANK, "alpha": 8, "target_modules": "all-linear"}
    raw["actor"]["optim"] = {**raw["actor"].get("optim", {}), "lr": 1e-3}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(path)
    plan = plan_run(cfg, backend, "ppo")
    assert [r.role for r in plan.roles] == ["rollout", "actor", "critic"]
    assert plan.lora_sync == ("adapters" if backend == "megatron-vllm" else "merged")
    assert "no reference model starts" in plan.describe()
    run = RunDir(tmp_path / "run")
    with ppo_trainer(cfg, plan, run) as (trainer, data):
        assert trainer.models.reference is None
        asyncio.run(train(trainer, run, data, None))
    run.close()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3]
    adapter_tensors = 2 * 7 * 2  # layers x all-linear modules x (A, B)
    for row in rows.values():
        assert row["sync/max_abs_logprob_diff"] <= 1e-3
        if backend == "megatron-vllm":  # the adapters alone, on each of the 2 replicas
            assert row["sync/held_checked"] == 2 * adapter_tensors, row["sync/held_checked"]
        else:  # merged: every tensor of the model (21), on each replica
            assert row["sync/held_checked"] == 2 * 21, row["sync/held_checked"]
    assert rows[1]["kl"] == 0.0  # before any update the actor is its base: the reference
    assert rows[3]["kl"] != 0.0
    adapter = tmp_path / "run/final/adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == RANK
    assert not (tmp_path / "run/final/actor").exists()  # merged only on actor.lora.export_merged
    model = peft.PeftModel.from_pretrained(load_hf(str(tiny_model)), str(adapter))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.isfinite(tuned).all() and float((tuned - base).abs().max()) > 0
