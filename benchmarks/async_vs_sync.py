"""Asynchronous against synchronous PPO: the same model, task, devices and batch sizes, in one run.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 20] [--warmup 2] [--backend megatron-vllm]
                                                 [--balanced] [--config FILE] [--a.b=VALUE ...]

For each mode in turn (sync, then async) the default job is prepared as `python -m xray.train ppo`
prepares it (the built-in warm-started tiny Llama; configs/ppo_tiny_cpu.yaml: makers on the rollout
device, trainer on the training device; any key overridable), fresh WholeModels start, and
`--warmup` + `--steps` PPO steps run (trainer steps in async mode: one experience batch each).
Both modes run with `pin_cpu_devices=true` unless told otherwise: each CPU device is one core, so
the two devices are two devices (unpinned, every Workhorse spreads over every core and the
comparison is of schedulers, not of layouts).
Throughput = samples trained in the timed steps / wall seconds from the end of the last warm-up
step to the end of the last step. Then greedy accuracy on the held-out prompts (the same number of
samples trained in both modes). The sync run's median seconds of generation and of scoring +
training + sync are printed: overlap can at best hide the shorter of the two.
Last line: `async_over_sync=<async samples/s / sync samples/s> eval_sync=<x> eval_async=<y>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time

from algorithms.ppo.detached import Detached
from algorithms.ppo.run import ppo_trainer
from algorithms.ppo.trainer import PPOTrainer
from xray.config import DEFAULT_CONFIGS
from xray.run.outputs import RunDir
from xray.train import resolve


BALANCED = ["--device_groups.train_group.workers=[actor, critic]",
            "--device_groups.rollout_group.workers=[rollout, reference]",
            "--ppo.ppo_epochs=1", "--ppo.mini_batch_size=128", "--actor.micro_batch_size=64",
            "--critic.micro_batch_size=64", "--reference.micro_batch_size=128",
            "--rollout.max_new_tokens=48", "--rollout.temperature=2.0"]
"""`--balanced`: the reference placed with the makers (a maker is rollout + reference + reward),
one PPO epoch of one mini-batch, and responses of up to 48 tokens sampled at temperature 2 (the
warm-started model stops after 2-4 tokens at temperature 1), so the makers' device carries more
of a step's work than in the default job."""


async def run_mode(trainer: PPOTrainer, data, steps: int, warmup: int) -> tuple[list[float], list[dict], float]:
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
    with tempfile.TemporaryDirectory() as tmp, ppo_trainer(cfg, plan, RunDir(tmp)) as (trainer, data):
        ends, rows, evaluated = asyncio.run(run_mode(trainer, data, args.steps, args.warmup))
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n_samples * args.steps
    out = {"samples_per_s": samples / (ends[-1] - ends[args.warmup - 1]), "eval": evaluated}
    timed = rows[args.warmup:]
    if mode == "sync":
        for phase in ("generate", "score", "train", "sync"):
            out[phase] = statistics.median(r[f"time/{phase}_s"] for r in timed)
        out["score_train_sync_s"] = statistics.median(r["time/score_s"] + r["time/train_s"] + r["time/sync_s"]
                                                      for r in timed)
    else:
        out["staleness"] = statistics.mean(r["async/staleness"] for r in timed)
        out["trainer_busy"] = statistics.median(r["async/trainer_busy"] for r in timed)
        out["maker_busy"] = statistics.median(r["async/maker_busy"] for r in timed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    parser.add_argument("--backend", default="megatron-vllm", help="TRAIN-GENERATION backend pair")
    parser.add_argument("--config", default=str(DEFAULT_CONFIGS["ppo"]), help="the run's YAML config")
    parser.add_argument("--balanced", action="store_true",
                        help="the setting closest to balanced devices: " + " ".join(BALANCED))
    args, overrides = parser.parse_known_args()
    if args.balanced:
        overrides = [*BALANCED, *overrides]
    if not any(o.startswith("--pin_cpu_devices") for o in overrides):
        overrides.insert(0, "--pin_cpu_devices=true")  # a CPU device is its core, in both modes
    args.warmup = max(1, args.warmup)
    logging.basicConfig(level=logging.WARNING)
    sync = measure("sync", args, overrides)
    asynchronous = measure("async", args, overrides)
    print(f"sync:  {sync['samples_per_s']:.1f} samples/s; per step: generation {sync['generate']:.3f} s, "
          f"scoring + training + sync {sync['score_train_sync_s']:.3f} s (score {sync['score']:.3f}, "
          f"train {sync['train']:.3f}, sync {sync['sync']:.3f})")
    print(f"async: {asynchronous['samples_per_s']:.1f} samples/s; mean staleness {asynchronous['staleness']:.2f}, "
          f"trainer busy {asynchronous['trainer_busy']:.2f}, maker busy {asynchronous['maker_busy']:.2f}")
    print(f"async_over_sync={asynchronous['samples_per_s'] / sync['samples_per_s']:.3f} "
          f"eval_sync={sync['eval']:.4f} eval_async={asynchronous['eval']:.4f}")


if __name__ == "__main__":
    main()
