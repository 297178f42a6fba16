"""Goodput of a synchronous PPO run that loses Workhorses and a node, against the same run unharmed.

    .venv/bin/python benchmarks/fault_injection.py [--steps 200] [--backend megatron-vllm] [--seed 0]
        [--faults-every 100] [--grace 1.0] [--stall-steps 40] [--config FILE] [--a.b=VALUE ...]

The default job (`python -m xray.train ppo`'s preparation, configs/ppo_tiny_cpu.yaml) lengthened
to `--steps` steps, a snapshot in memory after every step (`trainer.memory_snapshots`) and a
checkpoint on disk every 10 (`--trainer.save_every`; `--trainer.standby_workhorses=1` adds warm
standby processes, see docs/runs.md), on two Ray nodes of this machine
(`ray.cluster_utils.Cluster`), each holding its own half of the machine's cores: every process of
a node (its raylet, and the Workhorses it starts) is pinned to its cores, the driver to the head's,
so a lost node takes its compute with it. The train group (actor, critic, reference) is elastic
over two devices, one per node (`elasticity` {max_train_batch_size: 32, micro_batch_sizes: [16]}:
the default job's mini-batch of 32 at dp=2 and dp=1), the rollout on the head node. Run twice in
one process, uninterrupted and faulted, in an order drawn from `--seed`. Per `--faults-every`
steps of the run (at least one round), three faults at steps drawn (seeded) from the round's
stretches: the actor's rank-0 Workhorse SIGKILLed at a random moment of a step in its 15%-35%; the
critic's rank-0 Workhorse SIGTERMed as a preemption notice would be, with `--grace` seconds
(`trainer.drain_grace_s`) shorter than a step (the step is then aborted and run again, as a
preemption that will not wait for it), and SIGKILLed once the grace is over, as a step of its
40%-50% begins; the second node removed as a step of its 55%-75% begins (the group shrinks to
dp=1 on the head's cores alone, `xray/run/recovery/elastic.py`) and added back 10 steps later,
while the run goes on (it grows to dp=2 at the first step boundary after its processes for the
grow are warm, `Models.warm_joined`). Every time is taken in the driver. Figures:
- goodput = wall seconds of the uninterrupted run / of the faulted one (first step's end to the
  last step's end);
- seconds_per_fault = (wall of the faulted run - wall of the uninterrupted one) / faults;
- recovery_s = the slowest fault's seconds from the fault to the end of the step that was in
  flight when it hit, done again;
- lost_steps = the most steps that had finished before one fault and ran again after it;
- eval_gap = greedy accuracy on the held-out prompts after the uninterrupted run minus after the
  faulted one;
- checkpoint_stall = median driver step time of the steps that follow a per-step snapshot / of the
  steps that follow none, minus 1: `--stall-steps` more steps of the uninterrupted run, with the
  snapshot taken after every other step (a snapshot's copy and hand-out run during the next step).
Last line: `goodput=<x> recovery_s=<y> lost_steps=<n> eval_gap=<z> checkpoint_stall=<w>
seconds_per_fault=<s>`.
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
RAY_CONFIG = {"enable_metrics_collection": False}
"""As `xray.wholemodel.cluster.ensure_ray` starts a local cluster: without Ray's metrics, whose
agent, after a node's death, took the head node's core for ~12 s (measured; one core here, one of
many on a real head)."""


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

    checkpoints = FlashCheckpoints(run, trainer.models, keep_on_peers=True)  # as `xray.run.loop` for a synchronous run
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
        for kind, step, delay in faults["events"]:
            await at_step(step)
            if kind == "kill":
                await asyncio.sleep(delay)
                pid = await trainer.models.actor.shard_handles()[0].pid.remote()
                hit()
                os.kill(pid, signal.SIGKILL)
            elif kind == "term":  # a preemption notice, then the kill once its grace is over
                pid = await trainer.models.critic.shard_handles()[0].pid.remote()
                hit()
                os.kill(pid, signal.SIGTERM)
                await asyncio.sleep(faults["grace"])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            elif kind == "remove":
                hit()
                await asyncio.to_thread(cluster.remove_node, next(iter(cluster.worker_nodes)))
            else:  # the node back while the run goes on (a joining node costs a running job nothing)
                await asyncio.to_thread(add_worker, cluster)

    trainer.state.eval_before = await trainer.evaluate(data.eval_rows)
    task = asyncio.ensure_future(injector()) if faults else None
    await sync_steps(trainer, run, data, checkpoints, GracefulStop(), on_step)
    await checkpoints.finish()
    if task is not None:
        if task.done() and task.exception() is not None:  # a fault not injected: the figures would flatter
            raise RuntimeError("the fault injector failed") from task.exception()
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


_CORES = sorted(os.sched_getaffinity(0))
HEAD_CORES = set(_CORES[:max(1, len(_CORES) // 2)])
"""The head node's cores (its processes, and the driver's): the first half of this machine's."""
WORKER_CORES = set(_CORES[len(_CORES) // 2:]) or HEAD_CORES
"""The worker node's: the other half."""


def on_cores(cores: set[int], start):
    """`start()` with this thread pinned to `cores`: the processes it starts (a Ray node's raylet,
    and the workers that raylet forks) inherit them."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        return start()
    finally:
        os.sched_setaffinity(0, before)


def add_worker(cluster) -> None:
    """The worker node (again), on its cores, from a thread other than the main one: Ray registers a
    new node's exit hooks (a SIGTERM handler) only from the main thread, so this node's are left to
    `cluster.shutdown()`, which the benchmark always reaches."""
    cluster._shutdown_at_exit = False
    try:
        on_cores(WORKER_CORES, lambda: cluster.add_node(**WORKER))
    finally:
        cluster._shutdown_at_exit = True


def two_nodes():
    """A head node (the rollout's device and one train device) and a worker (one train device),
    each on its own cores; the driver then on the head's."""
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    bind_loopback()
    cluster = on_cores(HEAD_CORES, lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 6, "resources": {"xray_trainer": 1, "xray_head": 1}, "_system_config": RAY_CONFIG}))
    on_cores(WORKER_CORES, lambda: cluster.add_node(**WORKER))
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    os.sched_setaffinity(0, HEAD_CORES)
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
    parser.add_argument("--faults-every", type=int, default=100, help="steps per round of three faults")
    parser.add_argument("--grace", type=float, default=1.0, help="trainer.drain_grace_s, shorter than a step")
    parser.add_argument("--config", default=str(default_config("ppo")))
    parser.add_argument("--timeline", help="also write both runs' step end times and the faults to this JSON file")
    args, overrides = parser.parse_known_args()
    if not any(o.startswith("--trainer.save_every") for o in overrides):
        overrides.insert(0, "--trainer.save_every=10")
    rng = random.Random(args.seed)
    events, n = [], args.steps
    rounds = max(1, n // args.faults_every)
    for r in range(rounds):  # each round's faults in its own stretch of the run
        first, size = r * n // rounds, n // rounds
        remove = first + rng.randint(int(size * 0.55), int(size * 0.75))
        events += [("kill", first + rng.randint(max(1, int(size * 0.15)), int(size * 0.35)), rng.uniform(0.0, 1.0)),
                   ("term", first + rng.randint(int(size * 0.4), int(size * 0.5)), 0.0),
                   ("remove", remove, 0.0), ("add", remove + 10, 0.0)]
    faults = {"events": events, "grace": args.grace}
    if not any(o.startswith("--trainer.max_restarts") for o in overrides):
        overrides.insert(0, f"--trainer.max_restarts={3 * rounds + 2}")  # each fault a recovery
    if not any(o.startswith("--trainer.drain_grace_s") for o in overrides):
        overrides.insert(0, f"--trainer.drain_grace_s={args.grace}")
    logging.basicConfig(level=logging.WARNING)
    clean_first = rng.random() < 0.5  # the order of the two runs, drawn
    cluster, ray = two_nodes()
    try:
        runs = {}
        for name in (("clean", "faulted") if clean_first else ("faulted", "clean")):
            runs[name] = measure(args, overrides, cluster, faults if name == "faulted" else None)
            if not cluster.worker_nodes:  # the faulted run ended before its node came back
                on_cores(WORKER_CORES, lambda: cluster.add_node(**WORKER))  # the next run starts on both nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
    clean, faulted = runs["clean"], runs["faulted"]
    expected = sum(kind != "add" for kind, _, _ in events)
    if len(faulted["faults"]) != expected:
        raise SystemExit(f"{len(faulted['faults'])} of the {expected} faults hit the run (it ended first?); "
                         "no figures")
    f = figures(clean, faulted)
    if args.timeline:
        import json

        Path(args.timeline).write_text(json.dumps({"clean": clean["ends"], "faulted": faulted["ends"],
                                                   "faults": faulted["faults"]}))
    stall = statistics.median(clean["after_snapshot"]) / statistics.median(clean["after_none"]) - 1
    start = faulted["ends"][0][1]
    print(f"cores: head {sorted(HEAD_CORES)}, worker {sorted(WORKER_CORES)}; {'uninterrupted' if clean_first else 'faulted'} "
          f"run first; faults (s into the run, step in flight): "
          f"{[(round(t - start, 1), s) for t, s in faulted['faults']]} ({', '.join(f'{k} at step {s}' for k, s, _ in events)}; "
          f"grace {args.grace} s; final actor dp "
          f"{faulted['dp']}); wall {wall(clean):.1f} s uninterrupted, {wall(faulted):.1f} s faulted; steps run "
          f"{len(faulted['ends'])} for {n}; step after a snapshot {statistics.median(clean['after_snapshot']):.3f} s, "
          f"after none {statistics.median(clean['after_none']):.3f} s (medians of {len(clean['after_snapshot'])} and "
          f"{len(clean['after_none'])}); eval {clean['eval']:.3f} uninterrupted, {faulted['eval']:.3f} faulted")
    per_fault = (wall(faulted) - wall(clean)) / len(faulted["faults"])
    print(f"goodput={f['goodput']:.3f} recovery_s={f['recovery_s']:.1f} lost_steps={f['lost_steps']} "
          f"eval_gap={clean['eval'] - faulted['eval']:.3f} checkpoint_stall={stall:.3f} seconds_per_fault={per_fault:.1f}")


if __name__ == "__main__":
    main()
