"""Where a PPO step's time goes on the default job: model compute against the runtime's overhead.

    .venv/bin/python benchmarks/ppo_step.py [--small] [--steps 8] [--warmup 1] [--backend megatron-vllm]
                                            [--config FILE] [--a.b=VALUE ...]

One run prepares the default job exactly as `python -m xray.train ppo` does (configs/ppo_tiny_cpu.yaml
unless --config, any key overridable; the built-in warm-started tiny Llama, cached under $XRAY_CACHE
or ~/.cache/xray), starts its WholeModels, and runs `--warmup` PPO steps, then `--steps` timed ones,
through the real `RLTrainer.step`. `--small` is the small job where the runtime's own costs show
most: 8 prompts x 8 samples, 12 new tokens, one PPO epoch of one mini-batch of 64 (`SMALL`). For each step it records the wall-clock window of every phase
(generate, score, train, sync) and reads every Workhorse's busy intervals (`Workhorse.busy_time`:
time inside its methods; for the weight sync, the actor's export and the rollout's reload, not the
object-store transfer nor the waits).

Model compute of a window = the time in it during which at least one Workhorse is busy (the union
of all busy intervals): for calls that run concurrently it is the longest one's time, for calls
that run one after another their sum (the sync's export, reload and verification). Everything
else in the step is outside model compute: Ray calls, dispatch and collection, data movement, and
the driver's own work between phases (packing, GAE). The share by the simpler rule (a phase's
compute = its busiest role's busy time) is printed too. Figures are medians over the timed steps.
The last line is `overhead_share=<1 - compute / step time> tokens_per_s=<tokens / step time>
step_s_over_compute_s=<step time / compute>` (medians over steps), the tokens being a step's
prompt and response tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from contextlib import contextmanager

import xray.run.step as step_module
from algorithms.rl import rl_trainer as started_trainer
from xray.run.step import RLTrainer
from xray.run.models import Models
from xray.run.outputs import RunDir
from xray.train import resolve
from xray.workhorse.busy import covered_seconds
from algorithms.specs import default_config

PHASES = ("generate", "score", "train", "sync")
SMALL = ["--ppo.rollout_batch_size=8", "--rollout.n_samples=8", "--rollout.max_new_tokens=12",
         "--ppo.mini_batch_size=64", "--ppo.ppo_epochs=1"]
WINDOWS: list[dict[str, tuple[float, float]]] = []


class WindowedPhaseTimer(step_module.PhaseTimer):
    """The trainer's PhaseTimer that also keeps each phase's wall-clock window (epoch seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: dict[str, tuple[float, float]] = {}
        WINDOWS.append(self.windows)

    @contextmanager
    def __call__(self, phase: str):
        start = time.time()
        with super().__call__(phase):
            yield
        self.windows[phase] = (start, time.time())


def drain(models: Models) -> dict[str, list[tuple[float, float]]]:
    """Every Workhorse's busy intervals since the last drain, by role (all shards together)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for model in models.all():
        out[model.role] = [tuple(i) for shard in model.busy_time().get() for i in shard["intervals"]]
    return out


def measure_step(trainer: RLTrainer, models: Models, rows: list[dict]) -> dict[str, float]:
    """Run one step; its wall time, compute and overhead, in total and per phase."""
    drain(models)
    start = time.time()
    metrics = asyncio.run(trainer.step(rows))  # one loop per timed step: the drains sit between
    end = time.time()
    busy = drain(models)
    windows = WINDOWS[-1]
    everything = [i for intervals in busy.values() for i in intervals]
    out = {"step_s": end - start, "compute_s": covered_seconds(everything, start, end),
           "tokens": metrics["tokens_per_s"] * sum(metrics[f"time/{p}_s"] for p in PHASES)}
    for phase in PHASES:
        lo, hi = windows[phase]
        out[f"{phase}_s"] = hi - lo
        out[f"{phase}_compute_s"] = covered_seconds(everything, lo, hi)
        for role, intervals in busy.items():
            out[f"{phase}_{role}_busy_s"] = covered_seconds(intervals, lo, hi)
    out["driver_s"] = out["step_s"] - sum(out[f"{p}_s"] for p in PHASES)
    out["sync_verify_s"] = metrics["sync/verify_s"]
    return out


def report(steps: list[dict[str, float]], roles: list[str]) -> None:
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    print(f"medians over {len(steps)} steps; seconds")
    print(f"{'phase':<10} {'wall':>7} {'compute':>8} {'outside':>8}   busy per role")
    for phase in PHASES:
        wall, compute = med[f"{phase}_s"], med[f"{phase}_compute_s"]
        per_role = "  ".join(f"{r} {med[f'{phase}_{r}_busy_s']:.3f}" for r in roles
                             if med[f"{phase}_{r}_busy_s"] > 0.0005)
        print(f"{phase:<10} {wall:7.3f} {compute:8.3f} {wall - compute:8.3f}   {per_role}")
    print(f"{'driver':<10} {med['driver_s']:7.3f} {0.0:8.3f} {med['driver_s']:8.3f}   (between phases)")
    print(f"{'step':<10} {med['step_s']:7.3f} {med['compute_s']:8.3f} {med['step_s'] - med['compute_s']:8.3f}")
    print(f"sync verification: {med['sync_verify_s']:.3f} s of the sync phase")
    by_max = [1 - sum(max(s.get(f"{p}_{r}_busy_s", 0.0) for r in roles) for p in PHASES) / s["step_s"]
              for s in steps]
    print(f"overhead share if a phase's compute is its busiest role's: {statistics.median(by_max):.3f}")
    shares = [1 - s["compute_s"] / s["step_s"] for s in steps]
    rates = [s["tokens"] / s["step_s"] for s in steps]
    over = [s["step_s"] / s["compute_s"] for s in steps]
    print(f"overhead_share={statistics.median(shares):.3f} tokens_per_s={statistics.median(rates):.1f} "
          f"step_s_over_compute_s={statistics.median(over):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the small job (see SMALL)")
    parser.add_argument("--steps", type=int, default=8, help="timed PPO steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed PPO steps first")
    parser.add_argument("--backend", default="megatron-vllm", help="TRAIN-GENERATION backend pair")
    parser.add_argument("--config", default=str(default_config("ppo")), help="the run's YAML config")
    args, overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    small = SMALL if args.small else []
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", args.backend, "--config", args.config, *small, *overrides])
    step_module.PhaseTimer = WindowedPhaseTimer
    with tempfile.TemporaryDirectory() as tmp, started_trainer(cfg, plan, RunDir(tmp)) as (trainer, data):
        steps = []
        for i in range(args.warmup + args.steps):
            result = measure_step(trainer, trainer.models, data.next_train_rows())
            if i >= args.warmup:
                steps.append(result)
        roles = [m.role for m in trainer.models.all()]
    report(steps, roles)


if __name__ == "__main__":
    main()
