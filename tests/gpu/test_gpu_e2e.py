"""The GPU tier's end-to-end runs: `python -m xray.train` on one GPU, every role colocated
(`configs/ppo_gpu_1x.yaml`), in bf16, with Ray and DeepSpeed-Inference generating.

vLLM cannot travel to the lent GPU machine (517 MB, pinned to another torch: FACTS.md), so these
take the DeepSpeed-Inference rollout: PPO on `deepspeed-dsinfer` and GRPO on `megatron-dsinfer`,
3 steps each, with the weights handed from the actor to the rollout on the same GPU by CUDA IPC
(`sync.transport: auto` picks `ipc`: NCCL refuses a group of two processes on one GPU) and
verified after every sync. Skipped without CUDA, or without Ray (`tests/gpu/fetch_wheels.sh`
carries a slimmed Ray wheel; see `run_on_device.sh`).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAVE_RAY = importlib.util.find_spec("ray") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not HAVE_RAY, reason="needs Ray (tests/gpu/fetch_wheels.sh)")]

RUNS = {
    "ppo-deepspeed-dsinfer": ("ppo", "deepspeed-dsinfer", ()),
    "grpo-megatron-dsinfer": ("grpo", "megatron-dsinfer", ("--device_groups.gpu_group.workers=[actor,reference,rollout]",
                                                           "--rollout.n_samples=4")),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_three_colocated_bf16_steps_sync_through_cuda_ipc(tmp_path, name):
    algo, backend, extra = RUNS[name]
    run = tmp_path / name
    p = subprocess.run([sys.executable, "-m", "xray.train", algo, "--backend", backend, "--config",
                        "configs/ppo_gpu_1x.yaml", "--output-dir", str(run), "--trainer.steps=3",
                        "--trainer.save_every=3", *extra], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    assert "eval_before=" in p.stdout and "eval_after=" in p.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row.get("sync/max_abs_logprob_diff", 0.0) <= 0.25 and row["sync/held_exact"] >= 14, row  # verified
    trace = json.loads((run / "timeline.json").read_text())
    roles = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    methods = {(roles[e["pid"]], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ("rollout", "load_ipc") in methods and ("rollout", "generate") in methods, methods
