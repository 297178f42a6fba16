"""Elastic data parallelism across nodes: a run starts small, grows when a node joins, shrinks when it leaves.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`), each offering one device of the train
group (the custom resource `xray_trainer`; the rollout sits on the head through `xray_head`), but
the run starts with the head alone. A 10-step deepspeed-dsinfer run configured for actor, critic
and reference at ZeRO-3 dp=2 with elasticity {max_train_batch_size: 6, micro_batch_sizes: [2],
num_gpus_per_node: 2, version: 0.2, lr_scaling: linear} takes DeepSpeed's v0.2 batches: a whole
node of 2 devices is the block's one valid size (2 x 1 x 2 = 4, the configured lr), and one device,
outside that list, gets a batch of its own (2 x 3 x 1 = 6, lr x 6/4). It starts at dp=1; the
second node joins as step 3 begins and the run grows to dp=2 at a step boundary,
from that step's snapshot in memory; the node is removed as step 6 begins and the run shrinks to
dp=1 from the newest snapshot in memory (each shard's files, or their copy on the other node,
resharded through DeepSpeed's universal checkpoint), redoing at most the step in flight; it joins
again as step 8 begins and the run finishes at dp=2. The head's device stands throughout: its
Workhorses keep their processes through every resize.
"""
import asyncio
import collections
import itertools
import json
import logging
import os
import re
import signal

import pytest
import yaml

from tests.e2e.test_ppo_e2e import FP32_PROBE, config

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # 1.5 min: `make test-fast` leaves it out
WORKER = {"num_cpus": 2, "resources": {"xray_trainer": 1}}


@pytest.fixture
def head_only():
    """A cluster of the head node alone (one train device); the test adds and removes the second."""
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    bind_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 6, "resources": {"xray_trainer": 1, "xray_head": 1}})
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def elastic_config(tmp_path, model_dir, backend="deepspeed-dsinfer", steps=10):
    path = config(tmp_path, model_dir, backend)
    cfg = yaml.safe_load(path.read_text())
    cfg["device_groups"] = {
        "nproc_per_node": 3,
        "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"],
                        "resources": {"xray_trainer": 1}},
        "rollout_group": {"device": "CPU", "ranks": [2], "workers": ["rollout"], "resources": {"xray_head": 1}},
    }
    block = {"max_train_batch_size": 6, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 2,
             "num_gpus_per_node": 2, "version": 0.2, "lr_scaling": "linear"}
    for role in ("actor", "critic"):
        cfg[role]["elasticity"] = block
    for role in ("actor", "critic", "reference"):  # data-parallel over the group's devices
        cfg[role].update(tp=1, dp=2)
    cfg["rollout"]["dp"] = 1
    cfg["ppo"].update(rollout_batch_size=12, mini_batch_size=4)
    cfg["trainer"].update(steps=steps, save_every=2)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def change_nodes(trainer, cluster, events: list) -> None:
    """Add the worker node as step 3 begins, remove it as step 6 begins, add it again as step 8 begins."""
    import time

    for after, change in ((2, "added"), (5, "removed"), (7, "added")):
        while trainer.state.step < after:
            await asyncio.sleep(0.005)
        if change == "added":  # blocking the run's loop: the node is in, and the processes the group
            cluster.add_node(**WORKER)  # grows into are warm there (`Models.warm_joined`), before the step ends
            deadline = time.monotonic() + 120
            while not trainer.models.warm_joined("train_group") and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            await asyncio.to_thread(cluster.remove_node, next(iter(cluster.worker_nodes)))
        events.append((change, trainer.state.step))


def head_pids(models, head: str) -> dict[str, int]:
    """role -> pid of the trained group's Workhorse on the head node."""
    import ray

    out = {}
    for role in ("actor", "critic", "reference"):
        shards = getattr(models, role).shard_handles()
        nodes, pids = ray.get([s.node_id.remote() for s in shards]), ray.get([s.pid.remote() for s in shards])
        out[role] = next(pid for node, pid in zip(nodes, pids) if node == head)
    return out


def test_a_run_starts_small_grows_shrinks_and_grows_again(tmp_path, tiny_model, head_only, caplog):
    from algorithms.rl import rl_trainer
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = elastic_config(tmp_path, tiny_model)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "deepspeed-dsinfer", "--config", str(path),
                                  "--ray-address", head_only.address])
    lr = cfg.actor.optim.lr
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    events: list = []
    with rl_trainer(cfg, plan, run, head_only.address) as (trainer, data):
        assert trainer.models.actor.parallel.dp == 1  # started below its configured size
        first = head_pids(trainer.models, head_only.head_node.node_id)

        async def main() -> float:
            mover = asyncio.ensure_future(change_nodes(trainer, head_only, events))
            try:
                return await train(trainer, run, data, None)
            finally:
                mover.cancel()
        asyncio.run(main())
        assert trainer.models.actor.parallel.dp == 2, events
        # the head's device stood through the three resizes: its Workhorses kept their processes
        assert head_pids(trainer.models, head_only.head_node.node_id) == first, first
    assert [e for e, _ in events] == ["added", "removed", "added"] and trainer.state.step == 10, events
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    seen = [(r["step"], r["elastic/train_group_devices"], r["elastic/mini_batch_size"], r["actor/lr"]) for r in rows]
    assert seen[0][1:3] == (1.0, 6.0) and seen[-1][:3] == (10, 2.0, 4.0), seen
    for step, devices, mini, step_lr in seen:  # DeepSpeed's v0.2 batches and lr_scaling: linear at every size
        assert (mini, step_lr) == ((6.0, pytest.approx(lr * 1.5, rel=1e-9)) if devices == 1 else
                                   (4.0, pytest.approx(lr, rel=1e-9))), seen
    assert [d for d, _ in itertools.groupby(d for _, d, _, _ in seen)] == [1.0, 2.0, 1.0, 2.0], seen
    assert rows[-1]["elastic/resizes"] >= 3.0
    counts = collections.Counter(r["step"] for r in rows)
    log = caplog.text
    assert sorted(counts) == list(range(1, 11)) and max(counts.values()) <= 2, (counts, log[-4000:])  # at most
    # the step in flight
    assert sum(counts.values()) <= 11, (counts, log[-4000:])  # one node loss: one step redone at most
    assert all(r.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE for r in rows), rows
    assert "sync/max_abs_logprob_diff" in rows[0] and "sync/max_abs_logprob_diff" in rows[-1]  # first, last
    assert "elastic: train_group starts on 1 of its 2 devices" in log, log[-3000:]
    assert log.count("train_group: 1 -> 2 devices (devices joined)") == 2, log[-3000:]
    assert log.count("3 of 6 Workhorses kept their processes") == 2, log[-3000:]  # the grows: actor, critic, reference
    assert "3 of 3 Workhorses kept their processes" in log, log[-3000:]  # the shrink: the head's stood
    assert "train_group: 2 -> 1 devices" in log, log[-3000:]
    assert log.count("into the new size from memory") == 2, log[-3000:]  # the grows: no disk
    assert re.search(r"back at step \d+, restored from the in-memory snapshot \(replicated\)", log), log[-3000:]
    assert "WholeModel actor is gone" not in log  # the control planes stayed: only Workhorses restarted


async def sigterm_during(trainer, step: int, role: str, node: str, sent: list) -> None:
    """SIGTERM `role`'s Workhorse on node `node` 0.3 s into step `step` (a preemption notice)."""
    while trainer.state.step < step - 1:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.3)
    model = getattr(trainer.models, role)
    nodes = [await h.node_id.remote() for h in model.shard_handles()]
    rank = nodes.index(node)
    pid = await model.shard_handles()[rank].pid.remote()
    os.kill(pid, signal.SIGTERM)
    sent.append((rank, pid, trainer.state.step))


def kill_before_snapshot(monkeypatch, step: int, role: str, node: str, killed: list, weights: dict) -> None:
    """SIGKILL `role`'s Workhorse on node `node` as the snapshot of `step` is taken (after the step,
    before its copy is asked for): the rank that hands that snapshot out, its peer on the head
    keeping its own copy (`handers`). `weights`: the model's full weights just before ("taken") and
    just after the first restore of the run ("restored")."""
    import time

    from xray.run import resume
    from xray.run.checkpoints import FlashCheckpoints

    take, resume_from = FlashCheckpoints.take, resume.resume_from

    async def take_after_a_kill(self, at: int, *args, **kwargs):
        if at == step and not killed:
            model = getattr(self._models, role)
            weights["taken"] = await model.state_dict()
            nodes = [await h.node_id.remote() for h in model.shard_handles()]
            pid = await model.shard_handles()[nodes.index(node)].pid.remote()
            os.kill(pid, signal.SIGKILL)
            while os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read():
                time.sleep(0.01)
            killed.append((nodes.index(node), pid))
        return await take(self, at, *args, **kwargs)

    async def resume_and_read(trainer, *args, **kwargs):
        source = await resume_from(trainer, *args, **kwargs)
        if "restored" not in weights:
            weights["restored"] = await getattr(trainer.models, role).state_dict()
        return source
    monkeypatch.setattr(FlashCheckpoints, "take", take_after_a_kill)
    monkeypatch.setattr(resume, "resume_from", resume_and_read)


def test_a_workhorse_sigterm_shrinks_the_run_from_memory(tmp_path, tiny_model, head_only, caplog, monkeypatch):
    """Both nodes from the start (dp=2, megatron-vllm). The actor's Workhorse on the second node is
    killed as step 3's snapshot is taken: it is the rank that hands that snapshot out, so the
    snapshot stands on the copy its peer on the head keeps (`FlashCheckpoints._salvage`), the
    replacement restores step 3 from it, the same weights bit for bit, and nothing runs again (one
    step would with that snapshot lost; step 3 is no checkpoint step, at which every rank hands). Then the actor's Workhorse on the second node gets SIGTERM during step 5: Ray is told that
    node drains, and at the next step boundary the train group shrinks to dp=1 on the head,
    restored from that step's snapshot in memory (no disk, no step run again); the drained node's
    device is not counted free, so the group does not grow back onto it."""
    import torch

    from algorithms.rl import rl_trainer
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    worker = head_only.add_node(**WORKER)
    head_only.wait_for_nodes()
    path = elastic_config(tmp_path, tiny_model, "megatron-vllm", steps=7)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "megatron-vllm", "--config", str(path),
                                  "--ray-address", head_only.address])
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    sent: list = []
    killed: list = []
    weights: dict = {}
    kill_before_snapshot(monkeypatch, 3, "actor", worker.node_id, killed, weights)
    with rl_trainer(cfg, plan, run, head_only.address) as (trainer, data):
        assert trainer.models.actor.parallel.dp == 2

        async def main() -> float:
            term = asyncio.ensure_future(sigterm_during(trainer, 5, "actor", worker.node_id, sent))
            try:
                return await train(trainer, run, data, None)
            finally:
                term.cancel()
        asyncio.run(main())
        assert trainer.models.actor.parallel.dp == 1 and trainer.state.step == 7, sent
    log = caplog.text
    (killed_rank, _), = killed
    assert re.search(rf"snapshot of step 3: actor's copy or hand failed on ranks \[{killed_rank}\] .*; the copies "
                     rf"ranks \[{1 - killed_rank}\] keep in their processes stand in", log), log[-3000:]
    assert re.search(r"actor replaced; back at step 3, restored from the in-memory snapshot", log), log[-3000:]
    taken, restored = weights["taken"], weights["restored"]  # the kept copy restored step 3's weights, bit for bit
    assert sorted(taken) == sorted(restored) and all(torch.equal(taken[k], restored[k]) for k in taken)
    (rank, pid, sent_at), = sent
    after = re.search(rf"drain notice \(SIGTERM\) from actor rank {rank} \(pid {pid}\); replacing actor after step (\d+)", log)
    assert after and int(after.group(1)) in (sent_at, sent_at + 1), (sent, log[-3000:])  # the step boundary after it
    k = int(after.group(1))
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8)), [r["step"] for r in rows]  # nothing ran again
    assert [r["elastic/train_group_devices"] for r in rows] == [2.0] * k + [1.0] * (7 - k), rows
    assert f"train_group: 2 -> 1 devices (actor rank {rank} got SIGTERM: its node {worker.node_id[:8]} drains)" in log
    assert re.search(rf"actor shrank \(train_group\) after a drain notice in [\d.]+ s; at step {k}, restored from "
                     r"the in-memory snapshot", log), log[-3000:]
    assert "devices joined" not in log and "from disk" not in log and "not granted" not in log
