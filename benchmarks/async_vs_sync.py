"""Asynchronous against synchronous PPO: the same model, task, devices and samples, in one run,
in two settings.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 20] [--warmup 2] [--backend megatron-vllm]
                                                 [--settings compute,latency] [--config FILE] [--a.b=VALUE ...]

Settings:
- `compute`: the default job as `python -m xray.train ppo` runs it (the built-in warm-started tiny
  Llama, configs/ppo_tiny_cpu.yaml: the rollout on one device, actor, critic and reference on the
  other; any key overridable), scored by its reward function;
- `latency`: the same job scored by the built-in judge `xray.rewards.builtin:judged_answer`, which
  answers each sample after a seeded log-normal latency (median 150 ms, sigma 1.0) without using
  the CPU while it waits, as a remote verifier or sandbox would. The synchronous step scores its
  batch's samples concurrently (the judge is awaited on the whole batch at once), so its wait per
  step is the batch's slowest sample, not the sum.
For each setting, each mode in turn (sync, then async) prepares the job, starts fresh
WholeModels, and runs `--warmup` + `--steps` steps (trainer steps in async mode: one rollout
batch each). Both modes run with `pin_cpu_devices=true` unless told otherwise: each CPU device is
one core. Throughput = samples trained in the timed steps / wall seconds from the end of the last
warm-up step to the end of the last step; the ratio is async throughput over sync throughput
(numerator: async samples/s, denominator: sync samples/s), one number per setting from one run
of each mode. Then greedy accuracy on the held-out prompts (the same samples trained in both
modes): `eval_gap` is the largest eval_sync - eval_async over the settings. The sync run's median
seconds per step of generation + scoring and of training + sync are printed: overlap can at best
hide the shorter of the two.
Last line: `async_over_sync_compute=<x> async_over_sync_latency=<y> eval_gap=<g>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time

from xray.run.detached.supervisor import Detached
from algorithms.rl import rl_trainer
from xray.run.step import RLTrainer
from xray.run.outputs import RunDir
from xray.train import resolve
from algorithms.specs import default_config

SETTINGS = {"compute": [], "latency": ["--reward.function=xray.rewards.builtin:judged_answer"]}
"""Each setting's overrides of the job."""


async def run_mode(trainer: RLTrainer, data, steps: int, warmup: int) -> tuple[list[float], list[dict], float]:
    """Step end times, per-step metrics, and the eval after training."""
    ends, rows = [], []

    async def on_step(step: int, metrics: dict) -> None:
        ends.append(time.perf_counter())
        rows.append(metrics)

    span = range(1, warmup + steps + 1)
    if trainer.cfg.trainer.mode == "async":
        await Detached(trainer, data).run(span, on_step)
    else:
        for step in span:
            await on_step(step, await trainer.step(data.next_train_rows()))
    return ends, rows, await trainer.evaluate(data.eval_rows)


def measure(mode: str, args, overrides: list[str]) -> dict:
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", args.backend, "--config", args.config,
                                  f"--trainer.mode={mode}", *overrides])
    with tempfile.TemporaryDirectory() as tmp, rl_trainer(cfg, plan, RunDir(tmp)) as (trainer, data):
        ends, rows, evaluated = asyncio.run(run_mode(trainer, data, args.steps, args.warmup))
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n_samples * args.steps
    out = {"samples_per_s": samples / (ends[-1] - ends[args.warmup - 1]), "eval": evaluated}
    timed = rows[args.warmup:]
    if mode == "sync":
        out["generate_score_s"] = statistics.median(r["time/generate_s"] + r["time/score_s"] for r in timed)
        out["train_sync_s"] = statistics.median(r["time/train_s"] + r["time/sync_s"] for r in timed)
    else:
        for key in ("staleness_token_mean", "trainer_busy", "maker_busy", "push_latency_s"):
            out[key] = statistics.median(r[f"async/{key}"] for r in timed if f"async/{key}" in r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    parser.add_argument("--backend", default="megatron-vllm", help="TRAIN-GENERATION backend pair")
    parser.add_argument("--config", default=str(default_config("ppo")), help="the run's YAML config")
    parser.add_argument("--settings", default="compute,latency", help="comma-separated: compute, latency")
    args, overrides = parser.parse_known_args()
    if not any(o.startswith("--pin_cpu_devices") for o in overrides):
        overrides.insert(0, "--pin_cpu_devices=true")  # a CPU device is its core, in both modes
    args.warmup = max(1, args.warmup)
    logging.basicConfig(level=logging.WARNING)
    ratios, gaps = {}, []
    for setting in args.settings.split(","):
        sync = measure("sync", args, [*overrides, *SETTINGS[setting]])
        asynchronous = measure("async", args, [*overrides, *SETTINGS[setting]])
        ratios[setting] = asynchronous["samples_per_s"] / sync["samples_per_s"]
        gaps.append(sync["eval"] - asynchronous["eval"])
        print(f"{setting}: sync  {sync['samples_per_s']:.1f} samples/s; median per step: generate+score "
              f"{sync['generate_score_s']:.3f} s, train+sync {sync['train_sync_s']:.3f} s; eval {sync['eval']:.4f}")
        print(f"{setting}: async {asynchronous['samples_per_s']:.1f} samples/s; median staleness per token "
              f"{asynchronous['staleness_token_mean']:.2f}, trainer busy {asynchronous['trainer_busy']:.2f}, maker "
              f"busy {asynchronous['maker_busy']:.2f}, push latency {asynchronous['push_latency_s']:.3f} s; "
              f"eval {asynchronous['eval']:.4f}", flush=True)
    print(" ".join(f"async_over_sync_{s}={r:.3f}" for s, r in ratios.items()) + f" eval_gap={max(gaps):.4f}")


if __name__ == "__main__":
    main()
