"""xray's distributed pipeline learns: GRPO through the real command raises greedy accuracy.

`python -m xray.train grpo` as a user runs it (the default critic-free config: the built-in tiny
Llama warm-started by supervised fine-tuning, `builtin:arith`, Megatron actor and reference, a vLLM
rollout, every weight sync verified), shortened to `STEPS` steps, for each of two seeds. The warm
start is built once (by the first run, into the session's `XRAY_CACHE`, which the `ray job submit`
test reuses) and both seeds start from it. Greedy accuracy on the 200 held-out prompts is measured
by the rollout engine before and after training, so a step that trains the wrong way (a flipped
policy-loss sign, a broken advantage) lowers it, and a sync that never reaches the engine leaves it
exactly where it was; each seed must gain `MIN_GAIN` and the two together `MEAN_GAIN` on average.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SEEDS = (1, 2)
STEPS = 25
MIN_GAIN = 0.05
"""Each seed's gain in greedy accuracy (out of 1); see the module docstring for what it catches."""
MEAN_GAIN = 0.08
HELD = 7
"""Tensors of the built-in tiny Llama (2 layers) that the vLLM engine reads back and compares bit
for bit at every sync (`tests/e2e/test_ppo_e2e.HELD`)."""


def grpo(run: Path, seed: int, *overrides: str) -> tuple[float, float]:
    p = subprocess.run([sys.executable, "-m", "xray.train", "grpo", f"--output-dir={run}", f"--seed={seed}",
                        f"--trainer.steps={STEPS}", "--trainer.save_every=0", "--trainer.report=false",
                        "--trainer.loggers=[jsonl]", *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-6000:]
    result = re.fullmatch(r"eval_before=(\d\.\d{4}) eval_after=(\d\.\d{4})", p.stdout.strip().splitlines()[-1])
    assert result, p.stdout[-2000:]
    return float(result[1]), float(result[2])


def warm_started_model() -> Path:
    """The built-in model's warm start that the first run built (or found) in the session cache."""
    found = sorted((Path(os.environ["XRAY_CACHE"]) / "builtin").glob("tiny-llama-sft-*/model.safetensors"))
    assert len(found) == 1, found
    return found[0].parent


def test_grpo_raises_greedy_accuracy_over_two_seeds(tmp_path):
    gains = {}
    for seed in SEEDS:
        model = () if seed == SEEDS[0] else (f"--model.path={warm_started_model()}",)
        before, after = grpo(tmp_path / f"seed{seed}", seed, *model)
        gains[seed] = after - before
        rows = [json.loads(line) for line in (tmp_path / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:  # every step's sync reached the engine and was checked there, tensor by tensor
            assert r["sync/version"] == r["step"] and r["sync/held_checked"] == HELD, r
    print(f"greedy accuracy gains by seed: {gains}")
    assert min(gains.values()) >= MIN_GAIN, gains
    assert sum(gains.values()) / len(gains) >= MEAN_GAIN, gains
