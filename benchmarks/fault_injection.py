"""Goodput of a synchronous PPO run that loses a training Workhorse, against the same run unharmed.

    .venv/bin/python benchmarks/fault_injection.py [--steps 200] [--backend megatron-vllm] [--seed 0]
                                                   [--config FILE] [--a.b=VALUE ...]

The default job (`python -m xray.train ppo`'s preparation, configs/ppo_tiny_cpu.yaml) lengthened
to `--steps` steps with a flash checkpoint every 10 (`--trainer.save_every`), run twice in one
process: uninterrupted, then with the actor's rank-0 Workhorse SIGKILLed as a step begins, at a
step drawn (seeded) from the middle 60% of the run; the run replaces the actor, goes back to its
latest complete checkpoint and goes on (`algorithms/ppo/recovery.py`). Figures, of the faulted run:
- goodput = seconds of the steps that were kept (each step's last run: the sum of its phases) /
  wall seconds from the first step's start to the last step's end;
- recovery_s = seconds from the kill to the end of the first step after it that was kept;
- eval_gap = greedy accuracy on the held-out prompts after the uninterrupted run minus after the
  faulted one;
- checkpoint_stall = median seconds training stopped for a flash checkpoint (the faulted run's) /
  median seconds of a synchronous save of the same actor and critic (`WholeModel.save`, 3 times,
  measured at the end of the same run).
Node loss (elastic data parallelism) is not built: no node is removed.
Last line: `goodput=<x> recovery_s=<y> eval_gap=<z> checkpoint_stall=<w>`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from algorithms.ppo.run import ppo_trainer, sync_steps
from xray.config import DEFAULT_CONFIGS
from xray.run.checkpoints import FlashCheckpoints
from xray.run.graceful import GracefulStop
from xray.run.outputs import RunDir
from xray.train import resolve


async def steps_with_fault(trainer, data, run: RunDir, kill_at: int | None) -> dict:
    """Run the steps; (end time, duration) of each step's every run, the kill time, the stalls."""
    checkpoints = FlashCheckpoints(run, trainer.models)
    ends: list[tuple[int, float, float]] = []
    stalls: list[float] = []
    killed: list[float] = []

    async def on_step(step: int, metrics: dict) -> None:
        ends.append((step, time.perf_counter(), sum(v for k, v in metrics.items() if k.startswith("time/"))))
        if step % trainer.cfg.trainer.save_every == 0:
            from algorithms.ppo.run import save_checkpoint

            stalls.append(await save_checkpoint(trainer, checkpoints, data))

    async def killer() -> None:
        pid = await trainer.models.actor.shard_handles()[0].pid.remote()
        while trainer.state.step < kill_at - 1:
            await asyncio.sleep(0.002)
        killed.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)

    trainer.state.eval_before = await trainer.evaluate(data.eval_rows)
    task = asyncio.ensure_future(killer()) if kill_at else None
    await sync_steps(trainer, run, data, checkpoints, GracefulStop(), on_step)
    await checkpoints.finish()
    if task is not None:
        task.cancel()
    return {"ends": ends, "stalls": stalls, "killed": killed[0] if killed else None,
            "eval": await trainer.evaluate(data.eval_rows)}


async def synchronous_saves(trainer, directory: Path, times: int = 3) -> list[float]:
    out = []
    for i in range(times):
        t0 = time.perf_counter()
        await asyncio.gather(trainer.models.actor.save(str(directory / f"s{i}/actor")),
                             trainer.models.critic.save(str(directory / f"s{i}/critic")))
        out.append(time.perf_counter() - t0)
    return out


def measure(args, overrides: list[str], kill_at: int | None) -> dict:
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", args.backend, "--config", args.config,
                                  f"--trainer.steps={args.steps}", *overrides])
    with tempfile.TemporaryDirectory() as tmp, ppo_trainer(cfg, plan, RunDir(tmp)) as (trainer, data):
        run = RunDir(Path(tmp) / "run")

        async def both() -> dict:
            out = await steps_with_fault(trainer, data, run, kill_at)
            out["saves"] = await synchronous_saves(trainer, Path(tmp) / "sync") if kill_at else []
            return out
        return asyncio.run(both())


def figures(faulted: dict) -> tuple[float, float]:
    """(goodput, recovery_s) of the faulted run."""
    kept: dict[int, tuple[float, float]] = {}
    for step, end, seconds in faulted["ends"]:
        kept[step] = (end, seconds)  # a step run again: its last run is the one kept
    first_start = min(end - seconds for _, end, seconds in faulted["ends"])
    last_end = max(end for end, _ in kept.values())
    goodput = sum(seconds for _, seconds in kept.values()) / (last_end - first_start)
    after = [end for end, _ in kept.values() if end > faulted["killed"]]
    return goodput, min(after) - faulted["killed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="megatron-vllm")
    parser.add_argument("--seed", type=int, default=0, help="draws the step of the kill")
    parser.add_argument("--config", default=str(DEFAULT_CONFIGS["ppo"]))
    args, overrides = parser.parse_known_args()
    if not any(o.startswith("--trainer.save_every") for o in overrides):
        overrides.insert(0, "--trainer.save_every=10")
    logging.basicConfig(level=logging.WARNING)
    kill_at = random.Random(args.seed).randint(int(args.steps * 0.2), int(args.steps * 0.8))
    clean = measure(args, overrides, None)
    faulted = measure(args, overrides, kill_at)
    goodput, recovery = figures(faulted)
    stall = statistics.median(faulted["stalls"]) / statistics.median(faulted["saves"])
    print(f"killed the actor's rank 0 as step {kill_at} began; flash stall {statistics.median(faulted['stalls']):.3f} s "
          f"vs synchronous save {statistics.median(faulted['saves']):.3f} s; eval {clean['eval']:.3f} uninterrupted, "
          f"{faulted['eval']:.3f} faulted")
    print(f"goodput={goodput:.3f} recovery_s={recovery:.1f} eval_gap={clean['eval'] - faulted['eval']:.3f} "
          f"checkpoint_stall={stall:.3f}")


if __name__ == "__main__":
    main()
