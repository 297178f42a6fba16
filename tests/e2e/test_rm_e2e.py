"""`python -m xray.train rm` on both training backends (the critic sharded: Megatron tp=2, slow tier;
DeepSpeed ZeRO-3 dp=2), and its export as the `reward` role of a PPO run.

Each rm run: Bradley-Terry metrics for every step, a Hugging Face sequence-classification export
that `transformers` loads as it is and that ranks the held-out pairs exactly as the trained critic
did (the command's accuracy). The DeepSpeed export then scores the rollouts of a 3-step PPO run
whose actor trains LoRA adapters (issue 19's LoRA PPO e2e on deepspeed-dsinfer: merged weights
synced and verified each step, no reference model started; `tests/e2e/test_lora_e2e.py`).
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.e2e.test_lora_e2e import check_lora_run, with_lora
from tests.e2e.test_ppo_e2e import config, metrics, train

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def train_rm(tmp_path: Path, model_dir: Path, backend: str) -> tuple[Path, Path, float]:
    cfg = config(tmp_path, model_dir, backend)
    run = tmp_path / f"rm-{backend}"
    p = subprocess.run([sys.executable, "-m", "xray.train", "rm", "--backend", backend, "--config", str(cfg),
                        "--output-dir", str(run), "--rm.steps=4", "--rm.batch_size=4", "--rm.lr=1e-3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith(f"rm_model={run / 'final/reward_model'} eval_accuracy_before="), last
    return cfg, run, float(last.rsplit("eval_accuracy_after=", 1)[1])


def hf_accuracy(cfg_path: Path, directory: Path, workdir: Path) -> float:
    """Held-out pair accuracy of the exported directory, scored by `transformers` alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from algorithms.rm import preference_pairs
    from xray.builtin.sources import load_prompt_splits
    from xray.config import load_config
    from xray.data.sequences import pack_sequences

    cfg = load_config(cfg_path)
    tok = AutoTokenizer.from_pretrained(directory)
    _, held_out = load_prompt_splits(cfg.data, tok, workdir)
    pairs = preference_pairs(cfg, held_out, tok)
    batch = pack_sequences([p for p, _, _ in pairs for _ in range(2)], [r for _, c, j in pairs for r in (c, j)],
                           tok.pad_token_id)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    assert torch.isfinite(scores).all() and scores.std() > 0
    return float((scores[0::2] > scores[1::2]).float().mean())


@pytest.mark.parametrize("backend", [  # megatron-vllm in the slow tier: the default tier's budget
    pytest.param("megatron-vllm", marks=pytest.mark.slow), "deepspeed-dsinfer"])
def test_rm_trains_exports_and_scores_a_ppo_run(tmp_path, tiny_model, backend):
    cfg, run, accuracy = train_rm(tmp_path, tiny_model, backend)
    steps = metrics(run)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(math.isfinite(r["rm_loss"]) for r in steps.values())
    assert all(r["rm_accuracy"] * 4 == round(r["rm_accuracy"] * 4) for r in steps.values()), steps  # of 4 pairs
    export = run / "final/reward_model"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert hf_accuracy(cfg, export, tmp_path / "data") == pytest.approx(accuracy, abs=1e-9)
    if backend == "megatron-vllm":
        return
    data = yaml.safe_load(cfg.read_text())  # the DeepSpeed export as the reward role of a PPO run
    data["device_groups"]["rollout_group"]["workers"] = ["rollout", "reward"]
    data["reward"] = {"function": None, "model": str(export)}
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    with_lora(cfg)
    ppo_run = tmp_path / "ppo"
    p = train("--backend", backend, "--config", str(cfg), "--output-dir", str(ppo_run), "--trainer.steps=3",
              "--trainer.save_every=0", "--trainer.report=false")
    started = next(line for line in p.stderr.splitlines() if " started " in line)
    assert "reward (" in started and "reference" not in started, started  # LoRA: no reference model
    ppo_steps = metrics(ppo_run)
    assert all(math.isfinite(r["reward/mean"]) for r in ppo_steps.values())
    assert ppo_steps[1]["reward/std"] > 0  # the trained model's varying scores, not a constant
    check_lora_run(ppo_run, tiny_model, adapters_alone=False)
