"""Goodput of a synchronous PPO run that loses Workhorses and a node, against the same run unharmed.

    .venv/bin/python benchmarks/fault_injection.py [--steps 200] [--backend megatron-vllm] [--seed 0]
                                                   [--stall-steps 40] [--config FILE] [--a.b=VALUE ...]

The default job (`python -m xray.train ppo`'s preparation, configs/ppo_tiny_cpu.yaml) lengthened
to `--steps` steps, a snapshot in memory after every step (`trainer.memory_snapshots`) and a
checkpoint on disk every 10 (`--trainer.save_every`; `--trainer.standby_workhorses=1` adds warm
standby processes, see docs/runs.md), on two Ray nodes of this machine
(`ray.cluster_utils.Cluster`): the train group (actor, critic, reference) is elastic over two
devices, one per node (`elasticity` {max_train_batch_size: 32, micro_batch_sizes: [16]}: the
default job's mini-batch of 32 at dp=2 and dp=1), the rollout on the head node. Run twice in one
process, uninterrupted, then faulted, at steps drawn (seeded) from stretches of the run: the
actor's rank-0 Workhorse SIGKILLed at a random moment of a step in the 15%-35% stretch; the critic's
rank-0 Workhorse SIGTERMed as a preemption notice would be (SIGKILLed 5 s later if still alive) as
a step of the 40%-50% stretch begins; the second node removed as a step of the 55%-75% stretch
begins (the group shrinks to dp=1, `xray/run/recovery/elastic.py`) and added back 10 steps later (it
grows to dp=2 at the next step boundary). Every time is taken in the driver. Figures:
- goodput = wall seconds of the uninterrupted run / of the faulted one (first step's end to the
  last step's end);
- recovery_s = the slowest fault's seconds from the fault to the end of the step that was in
  flight when it hit, done again;
- lost_steps = the most steps that had finished before one fault and ran again after it;
- eval_gap = greedy accuracy on the held-out prompts after the uninterrupted run minus after the
  faulted one;
- checkpoint_stall = median driver step time of the steps that follow a per-step snapshot / of the
  steps that follow none, minus 1: `--stall-steps` more steps of the uninterrupted run, with the
  snapshot taken after every other step (a snapshot's copy and hand-out run during the next step).
Last line: `goodput=<x> recovery_s=<y> lost_steps=<n> eval_gap=<z> checkpoint_stall=<w>`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from algorithms.rl import rl_trainer
from xray.run.loop import sync_steps
from xray.run.checkpoints import FlashCheckpoints
from xray.run.graceful import GracefulStop
from xray.run.outputs import RunDir
from xray.train import resolve
from algorithms.specs import default_config


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


async def steps_with_fault(trainer, data, run: RunDir, cluster, faults: dict | None, stall_steps: int = 0) -> dict:
    """Run the steps (then, unfaulted, `stall_steps` more with a snapshot after every other one):
    each step's end time (every run of it), the faults (time, step in flight), the stall figures."""
    from xray.run.loop import save_checkpoint

    checkpoints = FlashCheckpoints(run, trainer.models)
    ends: list[tuple[int, float]] = []
    times: list[tuple[float, int]] = []
    alternate = [False]

    async def on_step(step: int, metrics: dict) -> None:
        ends.append((step, time.perf_counter()))
        if step % trainer.cfg.trainer.save_every == 0:
            await save_checkpoint(trainer, checkpoints, data)
        elif not alternate[0] or step % 2 == 0:
            await save_checkpoint(trainer, checkpoints, data, persist=False)

    async def at_step(step: int) -> None:
        while trainer.state.step < step - 1:
            await asyncio.sleep(0.002)

    def hit() -> None:
        times.append((time.perf_counter(), trainer.state.step + 1))

    async def injector() -> None:
        await at_step(faults["kill"])
        await asyncio.sleep(faults["kill_delay"])
        pid = await trainer.models.actor.shard_handles()[0].pid.remote()
        hit()
        os.kill(pid, signal.SIGKILL)
        await at_step(faults["term"])
        pid = await trainer.models.critic.shard_handles()[0].pid.remote()
        hit()
        os.kill(pid, signal.SIGTERM)
        await asyncio.sleep(5.0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await at_step(faults["remove"])
        hit()
        await asyncio.to_thread(cluster.remove_node, next(iter(cluster.worker_nodes)))
        await at_step(faults["add"])
        cluster.add_node(**WORKER)  # blocking the run's loop, as a node that joins between steps

    trainer.state.eval_before = await trainer.evaluate(data.eval_rows)
    task = asyncio.ensure_future(injector()) if faults else None
    await sync_steps(trainer, run, data, checkpoints, GracefulStop(), on_step)
    await checkpoints.finish()
    if task is not None:
        task.cancel()
    out = {"ends": list(ends), "faults": times, "eval": await trainer.evaluate(data.eval_rows),
           "dp": trainer.models.actor.parallel.dp}
    if stall_steps:
        alternate[0], first = True, len(ends)
        trainer.cfg = dataclasses.replace(trainer.cfg, trainer=dataclasses.replace(
            trainer.cfg.trainer, steps=trainer.cfg.trainer.steps + stall_steps))
        await sync_steps(trainer, run, data, checkpoints, GracefulStop(), on_step)
        await checkpoints.finish()
        after: dict[bool, list[float]] = {True: [], False: []}  # a snapshot after the step before?
        for (prev, t0), (_, t1) in zip(ends[first:], ends[first + 1:]):
            after[prev % 2 == 0 or prev % trainer.cfg.trainer.save_every == 0].append(t1 - t0)
        out["after_snapshot"], out["after_none"] = after[True], after[False]
    return out


def measure(args, overrides: list[str], cluster, faults: dict | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = elastic_config(args.config, Path(tmp))
        _, cfg, plan, _, _ = resolve(["ppo", "--backend", args.backend, "--config", config,
                                      f"--trainer.steps={args.steps}", *overrides])
        with rl_trainer(cfg, plan, RunDir(tmp), cluster.address) as (trainer, data):
            run = RunDir(Path(tmp) / "run")

            return asyncio.run(steps_with_fault(trainer, data, run, cluster, faults,
                                                0 if faults else args.stall_steps))


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


def wall(run: dict) -> float:
    """Seconds from the first step's end to the last step's end (every run of a step counted)."""
    return max(end for _, end in run["ends"]) - run["ends"][0][1]


def figures(clean: dict, faulted: dict) -> dict[str, float]:
    """goodput, recovery_s, lost_steps of the faulted run against the clean one (module docstring)."""
    recovery, lost = 0.0, 0
    bounds = [t for t, _ in faulted["faults"]] + [float("inf")]
    for (t, in_flight), upto in zip(faulted["faults"], bounds[1:]):
        again = [end for step, end in faulted["ends"] if step == in_flight and end > t]
        recovery = max(recovery, min(again) - t if again else float("inf"))
        done_before = {step for step, end in faulted["ends"] if end <= t}
        lost = max(lost, len({step for step, end in faulted["ends"] if t < end < upto and step in done_before}))
    return {"goodput": wall(clean) / wall(faulted), "recovery_s": recovery, "lost_steps": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="megatron-vllm")
    parser.add_argument("--seed", type=int, default=0, help="draws the steps of the faults")
    parser.add_argument("--stall-steps", type=int, default=40, help="steps measuring checkpoint_stall")
    parser.add_argument("--config", default=str(default_config("ppo")))
    parser.add_argument("--timeline", help="also write both runs' step end times and the faults to this JSON file")
    args, overrides = parser.parse_known_args()
    if not any(o.startswith("--trainer.save_every") for o in overrides):
        overrides.insert(0, "--trainer.save_every=10")
    if not any(o.startswith("--trainer.max_restarts") for o in overrides):
        overrides.insert(0, "--trainer.max_restarts=5")  # three faults, each a recovery
    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(args.seed)
    n = args.steps
    faults = {"kill": rng.randint(int(n * 0.15), int(n * 0.35)), "kill_delay": rng.uniform(0.0, 1.0),
              "term": rng.randint(int(n * 0.4), int(n * 0.5)), "remove": rng.randint(int(n * 0.55), int(n * 0.75))}
    faults["add"] = faults["remove"] + 10
    cluster, ray = two_nodes()
    try:
        clean = measure(args, overrides, cluster, None)
        faulted = measure(args, overrides, cluster, faults)
    finally:
        ray.shutdown()
        cluster.shutdown()
    f = figures(clean, faulted)
    if args.timeline:
        import json

        Path(args.timeline).write_text(json.dumps({"clean": clean["ends"], "faulted": faulted["ends"],
                                                   "faults": faulted["faults"]}))
    stall = statistics.median(clean["after_snapshot"]) / statistics.median(clean["after_none"]) - 1
    start = faulted["ends"][0][1]
    print(f"faults (s into the run, step in flight): {[(round(t - start, 1), s) for t, s in faulted['faults']]} "
          f"(actor SIGKILL {faults['kill_delay']:.2f} s after step {faults['kill'] - 1} ended, critic SIGTERM as step "
          f"{faults['term']} began, node removed as step {faults['remove']} began, back as {faults['add']} began; final actor dp "
          f"{faulted['dp']}); wall {wall(clean):.1f} s uninterrupted, {wall(faulted):.1f} s faulted; steps run "
          f"{len(faulted['ends'])} for {n}; step after a snapshot {statistics.median(clean['after_snapshot']):.3f} s, "
          f"after none {statistics.median(clean['after_none']):.3f} s (medians of {len(clean['after_snapshot'])} and "
          f"{len(clean['after_none'])}); eval {clean['eval']:.3f} uninterrupted, {faulted['eval']:.3f} faulted")
    print(f"goodput={f['goodput']:.3f} recovery_s={f['recovery_s']:.1f} lost_steps={f['lost_steps']} "
          f"eval_gap={clean['eval'] - faulted['eval']:.3f} checkpoint_stall={stall:.3f}")


if __name__ == "__main__":
    main()
