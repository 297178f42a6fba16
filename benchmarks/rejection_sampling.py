"""Rejection-sampling fine-tuning with the sample and distill jobs: does learning from the model's own
best-of-N right answers raise its held-out accuracy? Over seeds, one run.

    .venv/bin/python benchmarks/rejection_sampling.py [--seeds 1 2 3] [--backend megatron-vllm] [--a.b=VALUE ...]

For each seed, as a user runs them (a subprocess each, default configs, the built-in task):
  1. `python -m xray.train grpo --trainer.steps=0`: the warm-started built-in model's greedy accuracy
     on the 200 held-out prompts (`eval_before`; no step is taken);
  2. `python -m xray.train sample`: 8 candidates for each of 256 training prompts, the orm (the
     exact-answer function) on two devices, the best right answer of each prompt kept;
  3. `python -m xray.train distill --distill.dataset=...`: the warm-started model fine-tuned on them;
  4. step 1 again on the distilled model.
Per seed it prints the sample and distill lines and both accuracies. Extra `--a.b=VALUE` options go
to the sample and distill runs. Last line: `rft_gain_mean=<mean of eval_distilled - eval_warm>
rft_gain_min=<smallest over seeds> kept_share=<rows written / prompts sampled, mean>`.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "xray.train", *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"xray.train {' '.join(args)} failed:\n{p.stderr[-3000:]}")
    return p.stdout.strip().splitlines()[-1]


def held_out_accuracy(seed: int, backend: str, out: Path, model: str | None = None) -> float:
    extra = [f"--model.path={model}"] if model else []
    line = train("grpo", "--backend", backend, f"--seed={seed}", "--trainer.steps=0", *extra, "--output-dir", str(out))
    return float(re.search(r"eval_before=([\d.]+)", line).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--backend", default="megatron-vllm")
    args, extra = ap.parse_known_args()
    gains, kept = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            base = Path(tmp) / f"seed{seed}"
            warm = held_out_accuracy(seed, args.backend, base / "eval-warm")
            sampled = train("sample", "--backend", args.backend, f"--seed={seed}", *extra, "--output-dir",
                            str(base / "sample"))
            dataset = re.search(r"sample_dataset=(\S+)", sampled).group(1)
            distilled = train("distill", "--backend", args.backend, f"--seed={seed}", f"--distill.dataset={dataset}",
                              *extra, "--output-dir", str(base / "distill"))
            model = re.search(r"distill_model=(\S+)", distilled).group(1)
            after = held_out_accuracy(seed, args.backend, base / "eval-distilled", model)
            rows, prompts = (int(re.search(rf"{k}=(\d+)", sampled).group(1)) for k in ("rows", "prompts"))
            gains.append(after - warm)
            kept.append(rows / prompts)
            print(f"seed {seed}: {sampled}\n        {distilled}\n        held-out accuracy warm {warm:.3f} -> "
                  f"distilled {after:.3f}", flush=True)
    print(f"rft_gain_mean={statistics.mean(gains):.3f} rft_gain_min={min(gains):.3f} "
          f"kept_share={statistics.mean(kept):.3f}")


if __name__ == "__main__":
    main()
