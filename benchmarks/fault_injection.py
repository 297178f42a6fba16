"""Goodput of a synchronous PPO run that loses a training Workhorse and a node, against the same run unharmed.

    .venv/bin/python benchmarks/fault_injection.py [--steps 200] [--backend megatron-vllm] [--seed 0]
                                                   [--config FILE] [--a.b=VALUE ...]

The default job (`python -m xray.train ppo`'s preparation, configs/ppo_tiny_cpu.yaml) lengthened
to `--steps` steps with a flash checkpoint every 10 (`--trainer.save_every`), on two Ray nodes of
this machine (`ray.cluster_utils.Cluster`): the train group (actor, critic, reference) is elastic
over two devices, one per node (`elasticity` {max_train_batch_size: 32, micro_batch_sizes: [16]}:
the default job's mini-batch of 32 at dp=2 and dp=1), the rollout on the head node. Run twice in
one process: uninterrupted, then faulted: the actor's rank-0 Workhorse is SIGKILLed as a step
drawn (seeded) from the 20%-50% stretch of the run begins (the run replaces the train group and
goes back to its latest complete checkpoint, `algorithms/ppo/recovery.py`), the second node is
removed as a step drawn from the 55%-75% stretch begins (the group shrinks to dp=1 and goes back
to its checkpoint, `algorithms/ppo/elastic.py`), and added back 10 steps later (the group grows to
dp=2 at the next step boundary, from that step's checkpoint). Figures, of the faulted run:
- goodput = seconds of the steps that were kept (each step's last run: the sum of its phases) /
  wall seconds from the first step's start to the last step's end;
- recovery_s = the slowest of the two faults: seconds from the fault to the end of the first step
  after it that was kept;
- eval_gap = greedy accuracy on the held-out prompts after the uninterrupted run minus after the
  faulted one;
- checkpoint_stall = median seconds training stops for a flash checkpoint (the slowest Workhorse's
  blocking copy: the driver does not wait for it, `xray/run/checkpoints.py`) / median seconds the
  driver waits for a synchronous save (`WholeModel.save`) of the same actor and critic; both
  measured side by side at the end of the faulted run, alternating, 5 times each. The run's own
  copies are printed too: they run beside the next step's generation on the same cores, so their
  wall time is longer, while the step's generation (which needs no trained Workhorse) goes on.
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


WORKER = {"num_cpus": 2, "resources": {"xray_trainer": 1}}


def elastic_config(path: str, tmp: Path) -> str:
    """The config at `path` with the train group elastic over two nodes (see the docstring)."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())
    groups = cfg["device_groups"]
    groups["nproc_per_node"] = 3
    groups["train_group"].update(ranks=[0, 1], resources={"xray_trainer": 1})
    groups["rollout_group"].update(ranks=[2], resources={"xray_head": 1})
    mini, micro = cfg["ppo"]["mini_batch_size"], cfg["actor"]["micro_batch_size"]
    for role in ("actor", "critic", "reference"):
        cfg[role]["dp"] = 2
    for role in ("actor", "critic"):
        cfg[role]["elasticity"] = {"max_train_batch_size": mini, "micro_batch_sizes": [micro],
                                   "min_gpus": 1, "max_gpus": 2}
    out = tmp / "elastic.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(out)


async def steps_with_fault(trainer, data, run: RunDir, cluster, faults: dict | None) -> dict:
    """Run the steps; (end time, duration) of each step's every run, the fault times, the stalls."""
    checkpoints = FlashCheckpoints(run, trainer.models)
    ends: list[tuple[int, float, float]] = []
    stalls: list[float] = []
    times: list[float] = []

    async def on_step(step: int, metrics: dict) -> None:
        ends.append((step, time.perf_counter(), sum(v for k, v in metrics.items() if k.startswith("time/"))))
        if step % trainer.cfg.trainer.save_every == 0:
            from algorithms.ppo.run import save_checkpoint

            stalls.append(await save_checkpoint(trainer, checkpoints, data))  # the copy's seconds, to come

    async def at_step(step: int) -> None:
        while trainer.state.step < step - 1:
            await asyncio.sleep(0.002)

    async def injector() -> None:
        pid = await trainer.models.actor.shard_handles()[0].pid.remote()
        await at_step(faults["kill"])
        times.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)
        await at_step(faults["remove"])
        times.append(time.perf_counter())
        await asyncio.to_thread(cluster.remove_node, next(iter(cluster.worker_nodes)))
        await at_step(faults["add"])
        cluster.add_node(**WORKER)  # blocking the run's loop, as a node that joins between steps

    trainer.state.eval_before = await trainer.evaluate(data.eval_rows)
    task = asyncio.ensure_future(injector()) if faults else None
    await sync_steps(trainer, run, data, checkpoints, GracefulStop(), on_step)
    await checkpoints.finish()
    if task is not None:
        task.cancel()
    copies = await asyncio.gather(*stalls, return_exceptions=True)  # a snapshot its Workhorse died in: none
    return {"ends": ends, "stalls": [s for s in copies if isinstance(s, float)], "faults": times, "eval": await trainer.evaluate(data.eval_rows),
            "dp": trainer.models.actor.parallel.dp}


async def flash_and_synchronous(trainer, directory: Path, times: int = 5) -> tuple[list[float], list[float]]:
    """Side by side, alternating, on the trained run's actor and critic with nothing else running:
    the seconds a flash checkpoint stops training (the slowest Workhorse's blocking copy; then its
    write is waited for, outside the figure), and the seconds a synchronous save
    (`WholeModel.save`) keeps the driver waiting."""
    flash, sync = [], []
    checkpoints = FlashCheckpoints(RunDir(directory / "flash"), trainer.models)
    for i in range(times):
        for kind in (("flash", "sync") if i % 2 == 0 else ("sync", "flash")):
            if kind == "flash":
                flash.append(await (await checkpoints.take(i, {"step": i})))
                await checkpoints.finish()
                continue
            t0 = time.perf_counter()
            await asyncio.gather(trainer.models.actor.save(str(directory / f"s{i}/actor")),
                                 trainer.models.critic.save(str(directory / f"s{i}/critic")))
            sync.append(time.perf_counter() - t0)
    return flash, sync


def measure(args, overrides: list[str], cluster, faults: dict | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = elastic_config(args.config, Path(tmp))
        _, cfg, plan, _, _ = resolve(["ppo", "--backend", args.backend, "--config", config,
                                      f"--trainer.steps={args.steps}", *overrides])
        with ppo_trainer(cfg, plan, RunDir(tmp), cluster.address) as (trainer, data):
            run = RunDir(Path(tmp) / "run")

            async def both() -> dict:
                out = await steps_with_fault(trainer, data, run, cluster, faults)
                out["flash"], out["saves"] = (await flash_and_synchronous(trainer, Path(tmp) / "side")
                                              if faults else ([], []))
                return out
            return asyncio.run(both())


def two_nodes():
    """A head node (the rollout's device and one train device) and a worker (one train device)."""
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    bind_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 6, "resources": {"xray_trainer": 1, "xray_head": 1}})
    cluster.add_node(**WORKER)
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    return cluster, ray


def figures(faulted: dict) -> tuple[float, float]:
    """(goodput, recovery_s) of the faulted run."""
    kept: dict[int, tuple[float, float]] = {}
    for step, end, seconds in faulted["ends"]:
        kept[step] = (end, seconds)  # a step run again: its last run is the one kept
    first_start = min(end - seconds for _, end, seconds in faulted["ends"])
    last_end = max(end for end, _ in kept.values())
    goodput = sum(seconds for _, seconds in kept.values()) / (last_end - first_start)
    recovery = max(min(end for end, _ in kept.values() if end > t) - t for t in faulted["faults"])
    return goodput, recovery


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
    rng = random.Random(args.seed)
    faults = {"kill": rng.randint(int(args.steps * 0.2), int(args.steps * 0.5))}
    faults["remove"] = rng.randint(int(args.steps * 0.55), int(args.steps * 0.75))
    faults["add"] = faults["remove"] + 10
    cluster, ray = two_nodes()
    try:
        clean = measure(args, overrides, cluster, None)
        faulted = measure(args, overrides, cluster, faults)
    finally:
        ray.shutdown()
        cluster.shutdown()
    goodput, recovery = figures(faulted)
    stall = statistics.median(faulted["flash"]) / statistics.median(faulted["saves"])
    print(f"killed the actor's rank 0 as step {faults['kill']} began, removed the second node as step "
          f"{faults['remove']} began and added it back as step {faults['add']} began (final actor dp "
          f"{faulted['dp']}); flash stall {statistics.median(faulted['flash']):.4f} s vs synchronous save "
          f"{statistics.median(faulted['saves']):.4f} s side by side (the run's own copies, beside generation: "
          f"{statistics.median(faulted['stalls']):.4f} s); eval {clean['eval']:.3f} uninterrupted, "
          f"{faulted['eval']:.3f} faulted")
    print(f"goodput={goodput:.3f} recovery_s={recovery:.1f} eval_gap={clean['eval'] - faulted['eval']:.3f} "
          f"checkpoint_stall={stall:.3f}")


if __name__ == "__main__":
    main()
