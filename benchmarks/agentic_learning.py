"""Does multi-turn GRPO with a tool learn? The calculator job over seeds, as a user runs it.

    .venv/bin/python benchmarks/agentic_learning.py [--seeds 1 2] [--backend megatron-vllm] [--a.b=VALUE ...]

For each seed, one subprocess: `python -m xray.train grpo --config configs/grpo_calculator_cpu.yaml`
(the built-in tiny Llama warm-started on `builtin:calculator`'s tool-use demonstrations, then GRPO
on episodes: the model calls the calculator, reads its answer and writes the result). Greedy
accuracy on the 200 held-out prompts is measured by the rollout engine before and after the RL
steps (`eval_before`, `eval_after`), as is the share of those greedy episodes that called the
tool (`greedy_tool_share_before`, `_after`, from the run's eval.json; greedy decoding makes it all
or nothing per prompt); and the share of the sampled episodes (temperature 1, the policy's own
propensity) that called it, at the first step and over the last five (`tool_share_before`,
`_after`, from metrics.jsonl). `rl_s` is the RL part's wall time: from
the warm start's end (the first eval's start) to the run's end, the warm start left out (it is
cached and shared by later runs of the same seed). Extra `--a.b=VALUE` options go to the runs.
Last line: `gain_min=<smallest eval_after - eval_before over seeds> gain_mean=<mean>
tool_share_gain_min=<smallest tool_share_after - tool_share_before> rl_s_max=<longest rl_s>`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, backend: str, out: Path, extra: list[str]) -> dict:
    """One GRPO calculator run; its evaluations and RL wall time."""
    command = [sys.executable, "-m", "xray.train", "grpo", "--backend", backend, "--config",
               str(ROOT / "configs/grpo_calculator_cpu.yaml"), f"--seed={seed}", "--output-dir", str(out), *extra]
    started = time.time()
    p = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    ended = time.time()
    if p.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{p.stderr[-3000:]}")
    evals = json.loads((out / "eval.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shares = [row["episode/tool_call_share"] for row in steps if "episode/tool_call_share" in row]
    warm_end = _warm_start_end(out, started)
    return {"seed": seed, "eval_before": evals["eval_before"], "eval_after": evals["eval_after"],
            "greedy_tool_share_before": evals["episodes_before"]["episode/tool_call_share"],
            "greedy_tool_share_after": evals["episodes_after"]["episode/tool_call_share"],
            "tool_share_before": shares[0], "tool_share_after": statistics.mean(shares[-5:]),
            "rl_s": ended - warm_end, "total_s": ended - started}


def _warm_start_end(out: Path, started: float) -> float:
    """When the warm start ended: its exported model's time (the run's start when it was cached)."""
    final = out / "warm-start" / "final"
    return final.stat().st_mtime if final.is_dir() else started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--backend", default="megatron-vllm")
    args, extra = parser.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            row = run_seed(seed, args.backend, Path(tmp) / f"seed{seed}", extra)
            rows.append(row)
            print(f"seed {seed}: eval {row['eval_before']:.3f} -> {row['eval_after']:.3f} "
                  f"(gain {row['eval_after'] - row['eval_before']:+.3f}), tool share sampled "
                  f"{row['tool_share_before']:.3f} -> {row['tool_share_after']:.3f}, greedy "
                  f"{row['greedy_tool_share_before']:.3f} -> {row['greedy_tool_share_after']:.3f}, RL {row['rl_s']:.0f} s "
                  f"({row['total_s']:.0f} s with the warm start)", flush=True)
    gains = [r["eval_after"] - r["eval_before"] for r in rows]
    tools = [r["tool_share_after"] - r["tool_share_before"] for r in rows]
    print(f"gain_min={min(gains):.3f} gain_mean={statistics.mean(gains):.3f} "
          f"tool_share_gain_min={min(tools):.3f} rl_s_max={max(r['rl_s'] for r in rows):.0f}")


if __name__ == "__main__":
    main()
