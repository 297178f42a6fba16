"""`python -m xray.train sample` with ms-swift's device_groups example (a 2-device `sample_group`
with the sampler, a 2-device `rm_group` with the prm and the orm), then `distill` on what it wrote.

The orm is a reward function in a file (a response's length, and the pid of the process it ran
in), so every candidate's outcome score is known and the function's two replicas can be counted;
the prm is a sequence-classification head on the tiny model. `keep: all` writes every candidate
with its scores: the test checks each against the rules of `algorithms/best_of_n.py` (weakest
step, `10 x orm + prm`, rank order, the threshold). 15 prompts in batches of 6 exercise the
overlapped generation and a last batch that does not split over the sampler's two replicas.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ORM = '''import os
from pathlib import Path


def length_score(completions, **_):
    with open(Path(__file__).parent / "pids", "a") as f:
        f.write(f"{os.getpid()}\\n")
    return [float(len(c)) for c in completions]
'''
MS_SWIFT_GROUPS = """
nproc_per_node: 4
sample_group:
  device: CPU
  ranks: list(range(0, 2))
  workers:
    - sampler
rm_group:
  device: CPU
  ranks: list(range(2, 4))
  workers:
    - prm
    - orm
"""


def run(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "xray.train", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    return p.stdout.strip().splitlines()[-1]


def sample_config(tmp_path: Path, model_dir: Path) -> Path:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    prm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, pad_token_id=0)
    prm.save_pretrained(tmp_path / "prm")
    (tmp_path / "orm.py").write_text(ORM)
    cfg = yaml.safe_load((ROOT / "configs/sample_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(model_dir)
    cfg["device_groups"] = yaml.safe_load(MS_SWIFT_GROUPS)
    cfg["rollout"].update(dp=2, n_samples=4, max_new_tokens=12)
    cfg["reward"] = {"function": f"{tmp_path / 'orm.py'}:length_score"}
    cfg["sample"].update(keep="all", num_prompts=15, batch_prompts=6, prm_model=str(tmp_path / "prm"),
                         step_separator="e", orm_threshold=None, prm_threshold=0.5)
    cfg["data"]["eval_size"] = 8
    path = tmp_path / "sample.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def check_rows(rows: list[dict]) -> None:
    assert len(rows) == 15 * 4
    by_prompt: dict[str, list[dict]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], []).append(r)
        assert r["orm_score"] == float(len(r["response"]))  # the function's own score, as it returned it
        steps = r["prm_steps"]
        assert all(0.0 < s < 1.0 for s in steps) and (steps or r["response"] == "")
        assert r["prm_score"] == pytest.approx(min(steps) if steps else 0.0, abs=1e-6)
        assert r["score"] == pytest.approx(10.0 * r["orm_score"] + r["prm_score"], abs=1e-5)
        assert r["passed"] == (r["prm_score"] >= 0.5) and "answer" in r
    assert len(by_prompt) == 15
    for group in by_prompt.values():
        group.sort(key=lambda r: r["rank"])
        assert [r["rank"] for r in group] == [0, 1, 2, 3] and sorted(r["candidate"] for r in group) == [0, 1, 2, 3]
        assert all(a["score"] >= b["score"] for a, b in zip(group, group[1:]))
    assert any(len(r["prm_steps"]) >= 2 for r in rows), "no response had two steps: the PRM's steps go unchecked"
    assert len({r["orm_score"] for r in rows}) > 1 and len({round(r["prm_score"], 6) for r in rows}) > 1


def test_sample_with_ms_swift_groups_then_distill(tmp_path, tiny_model):
    cfg = sample_config(tmp_path, tiny_model)
    out = tmp_path / "sample"
    last = run("sample", "--config", str(cfg), "--output-dir", str(out))
    dataset = out / "sampling.jsonl"
    assert last.startswith(f"sample_dataset={dataset} prompts=15 candidates=60 rows=60 "), last
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    check_rows(rows)
    assert float(last.rsplit("orm_mean=", 1)[1].split()[0]) == pytest.approx(
        sum(r["orm_score"] for r in rows) / 60, abs=1e-4)
    pids = set((tmp_path / "pids").read_text().split())
    assert len(pids) == 2  # the orm function ran in its two replicas on rm_group's devices
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # batches of 6, 6 and 3 prompts

    run_dir = tmp_path / "distill"
    last = run("distill", "--output-dir", str(run_dir), f"--model.path={tiny_model}", f"--distill.dataset={dataset}",
               "--sft.steps=12", "--sft.batch_size=16", "--sft.lr=1e-3")
    assert last.startswith(f"distill_model={run_dir / 'final/actor'} rows=60 "), last
    first, final = (float(last.split(f"{k}=")[1].split()[0]) for k in ("loss_first", "loss_last"))
    assert math.isfinite(first) and final < first
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(run_dir / "final/actor").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
