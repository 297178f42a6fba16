"""Does PPO hold what it learned to the end of a run? Evaluation curves over seeds, two tasks.

    .venv/bin/python benchmarks/ppo_stability.py [--seeds 1 2 3] [--algo ppo] [--backend megatron-vllm]
                                                 [--reverse-steps 100] [--a.b=VALUE ...]

For each seed, `python -m xray.train <algo>` runs (a subprocess each, as a user runs it) on:
  - default: the default job (configs, 80 steps, `builtin:arith`, 200 held-out prompts);
  - reverse: `builtin:reverse` (a number's digits backwards, 200 held out) for `--reverse-steps`
             steps from a shorter warm start (40 supervised steps: held-out accuracy about 0.4),
             where the policy becomes nearly always right, held-out prompts included, and nearly
             deterministic: the regime where a late update can undo what was learned.
             (`builtin:arith_small`'s held-out accuracy stays near 0.5 while its training reward
             reaches 0.96: its 150 training sums do not teach the 50 held out.)
with greedy held-out evaluation every tenth of the run (`trainer.eval_every`). Per run it prints
eval before, at 80% of the steps, the best of the last 20% and after, the peak, and the largest
per-token KL figures. `fallback` = best eval over the last 20% of steps (from the 80% mark on)
minus the eval after the last step: how much a late update undid (0: the run ended at its best).
Last line: `fallback_max=<largest fallback of any run> default_gain=<mean eval_after - eval_before>
reverse_eval_after=<mean eval_after on reverse> reverse_late_min=<lowest eval of any reverse run over
its last 20% of steps>`.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(algo: str, backend: str, seed: int, task: str, steps: int, extra: list[str], out: Path) -> dict:
    args = [f"--seed={seed}", f"--trainer.steps={steps}", f"--trainer.eval_every={max(1, steps // 10)}",
            f"--trainer.save_every={steps}"]
    if task == "reverse":
        args += ["--data.path=builtin:reverse", "--sft.steps=40"]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "xray.train", algo, "--backend", backend, *args, *extra,
                        "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{task} seed {seed} failed:\n{p.stderr[-3000:]}")
    before, after = map(float, re.search(r"eval_before=([\d.]+) eval_after=([\d.]+)", p.stdout).groups())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval"] for r in rows if "eval" in r}
    curve[steps] = after  # the last step's evaluation is the run's own
    mark = int(0.8 * steps)
    late = [e for s, e in curve.items() if s >= mark]
    return dict(task=task, seed=seed, before=before, at80=curve.get(mark, late[0]), late_best=max(late),
                late_min=min(late),
                after=after, peak=max(curve.values()), fallback=max(late) - after,
                kl_max=max(r.get("kl", 0.0) for r in rows), kl_k3_max=max(r.get("kl_k3", 0.0) for r in rows),
                skipped=sum(r.get("actor/updates_skipped", 0.0) for r in rows), wall_s=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--algo", default="ppo")
    ap.add_argument("--backend", default="megatron-vllm")
    ap.add_argument("--reverse-steps", type=int, default=100)
    args, extra = ap.parse_known_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for task, steps in (("default", 80), ("reverse", args.reverse_steps)):
            for seed in args.seeds:
                r = run(args.algo, args.backend, seed, task, steps, extra, Path(tmp) / f"{task}-{seed}")
                results.append(r)
                print(f"{task:<7} seed {seed}: before {r['before']:.3f} at80% {r['at80']:.3f} "
                      f"late_best {r['late_best']:.3f} after {r['after']:.3f} peak {r['peak']:.3f} "
                      f"fallback {r['fallback']:.3f} kl_max {r['kl_max']:.3f} kl_k3_max {r['kl_k3_max']:.3f} "
                      f"updates_skipped {r['skipped']:.0f} ({r['wall_s']:.0f} s)", flush=True)
    default = [r for r in results if r["task"] == "default"]
    reverse = [r for r in results if r["task"] == "reverse"]
    print(f"fallback_max={max(r['fallback'] for r in results):.3f} "
          f"default_gain={statistics.mean(r['after'] - r['before'] for r in default):.3f} "
          f"reverse_eval_after={statistics.mean(r['after'] for r in reverse):.3f} "
          f"reverse_late_min={min(r['late_min'] for r in reverse):.3f}")


if __name__ == "__main__":
    main()
