"""Three-step PPO with quantized experience makers (`rollout.quantization=fp8`), through the real
command: the trained roles on Megatron in fp32, a vLLM rollout in bf16 quantized to fp8 per
channel (vLLM's `fp8_per_channel` on CPU), requantized at every sync.

Each step's sync is verified: the engine's fp8 codes and scales equal our own quantization of
the tensors sent, for every tensor (the 8 linear layers quantized, the 7 others in bf16: none
unreadable, unlike an unquantized CPU engine whose linear layers are repacked away), and the
probe stays within its loose quantized bound. The policy loss weights tokens by the truncated
importance weight (reported as `actor/behaviour_weight`) and the rollout/actor log-prob gap is
reported; the plan printed by `--dry-run` names the scheme. Smallest layout: one Workhorse per role
group, 8 prompts a step.
"""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
HELD_PER_SYNC = 15  # the tiny model: embedding, lm_head, 5 norms, 2 x (qkv, o, gate_up, down)


def quantized_config(tmp_path: Path, model_dir: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "configs/ppo_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(model_dir)
    for role in ("actor", "critic", "reference"):
        cfg[role]["micro_batch_size"] = 4
    cfg["rollout"].update(max_new_tokens=4, dtype="bfloat16", quantization="fp8")
    cfg["ppo"].update(rollout_batch_size=8, mini_batch_size=4, ppo_epochs=1)
    cfg["reward"]["function"] = "tests.e2e.test_critic_free_e2e:digit_share"  # graded: the model earns some
    cfg["data"]["eval_size"] = 8
    cfg["trainer"].update(steps=3, save_every=0, report=False, loggers=["jsonl"])
    path = tmp_path / "quantized.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_three_steps_with_fp8_makers_verify_every_sync(tmp_path, tiny_model):
    cfg, run = quantized_config(tmp_path, tiny_model), tmp_path / "run"
    command = [sys.executable, "-m", "xray.train", "ppo", "--backend", "megatron-vllm", "--config", str(cfg)]
    plan = subprocess.run([*command, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "rollout quantization: vLLM fp8_per_channel" in plan.stdout, plan.stderr

    t0 = time.perf_counter()
    p = subprocess.run([*command, "--output-dir", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-6000:]
    print(f"fp8 PPO e2e: 3 steps in {wall:.0f} s")
    assert "eval_before=" in p.stdout and "eval_after=" in p.stdout
    steps = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(steps) == [1, 2, 3]
    for row in steps.values():
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["sync/held_exact"] == HELD_PER_SYNC, row  # every tensor, fp8 layers included
        assert row.get("sync/max_abs_logprob_diff", 0.0) <= 1.0  # the loose quantized probe bound
        # fp8 samples are not the actor's: a gap, weighted out by the truncated importance weight
        assert 0.0 < row["rollout_logprob_gap_mean"] <= row["rollout_logprob_gap_max"], row
        assert 0.0 < row["actor/behaviour_weight"] <= 2.0, row
