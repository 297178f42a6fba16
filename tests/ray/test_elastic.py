"""Elastic data parallelism across nodes: a run loses a node, goes on at dp=1, gets it back, returns to dp=2.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`), each offering one device of the train
group (the custom resource `xray_trainer`; the rollout sits on the head through `xray_head`). A
10-step deepspeed-dsinfer run starts with actor, critic and reference at ZeRO-3 dp=2, one device on
each node, and elasticity {max_train_batch_size: 6, micro_batch_sizes: [2]}: the mini-batch is
2 x 1 x 2 = 4 at dp=2 and 2 x 3 x 1 = 6 at dp=1. The second node is removed as step 4 begins and
added back as step 7 begins: the run shrinks to one device (from the step-2 checkpoint, resharded
through DeepSpeed's universal checkpoint), trains at dp=1 with a mini-batch of 6, grows back to
two devices at a step boundary (from that step's checkpoint) and finishes at dp=2 with 4.
"""
import asyncio
import collections
import json
import logging

import pytest
import yaml

from tests.e2e.test_ppo_e2e import FP32_PROBE, config

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # 1.5 min: `make test-fast` leaves it out
WORKER = {"num_cpus": 2, "resources": {"xray_trainer": 1}}


@pytest.fixture
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    bind_loopback()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 6, "resources": {"xray_trainer": 1, "xray_head": 1}})
    cluster.add_node(**WORKER)
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def elastic_config(tmp_path, model_dir):
    path = config(tmp_path, model_dir, "deepspeed-dsinfer")
    cfg = yaml.safe_load(path.read_text())
    cfg["device_groups"] = {
        "nproc_per_node": 3,
        "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"],
                        "resources": {"xray_trainer": 1}},
        "rollout_group": {"device": "CPU", "ranks": [2], "workers": ["rollout"], "resources": {"xray_head": 1}},
    }
    block = {"max_train_batch_size": 6, "micro_batch_sizes": [2], "min_gpus": 1, "max_gpus": 2}
    for role in ("actor", "critic"):
        cfg[role]["elasticity"] = block
    cfg["rollout"]["dp"] = 1
    cfg["ppo"].update(rollout_batch_size=12, mini_batch_size=4)
    cfg["trainer"].update(steps=10, save_every=2)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


async def change_nodes(trainer, cluster, events: list) -> None:
    """Remove the worker node as step 4 begins; add one back as step 7 begins."""
    while trainer.state.step < 3:
        await asyncio.sleep(0.002)
    worker = cluster.worker_nodes and next(iter(cluster.worker_nodes))
    await asyncio.to_thread(cluster.remove_node, worker)
    events.append(("removed", trainer.state.step))
    while trainer.state.step < 6:
        await asyncio.sleep(0.01)
    cluster.add_node(**WORKER)  # blocking the run's loop: the node is in before the run can end
    events.append(("added", trainer.state.step))


def test_a_node_leaves_and_comes_back(tmp_path, tiny_model, two_nodes, caplog):
    from algorithms.ppo.run import ppo_trainer, train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = elastic_config(tmp_path, tiny_model)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "deepspeed-dsinfer", "--config", str(path),
                                  "--ray-address", two_nodes.address])
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    events: list = []
    with ppo_trainer(cfg, plan, run, two_nodes.address) as (trainer, data):
        assert trainer.models.actor.parallel.dp == 2

        async def main() -> float:
            mover = asyncio.ensure_future(change_nodes(trainer, two_nodes, events))
            try:
                return await train(trainer, run, data, None)
            finally:
                mover.cancel()
        asyncio.run(main())
        assert trainer.models.actor.parallel.dp == 2, events
    assert [e for e, _ in events] == ["removed", "added"] and trainer.state.step == 10
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    devices = [(r["step"], r["elastic/train_group_devices"], r["elastic/mini_batch_size"]) for r in rows]
    assert devices[0] == (1, 2.0, 4.0) and devices[-1] == (10, 2.0, 4.0), devices
    assert any(d == 1.0 and mb == 6.0 for _, d, mb in devices), devices  # went on at dp=1, recomputed batch
    assert rows[-1]["elastic/resizes"] >= 2.0
    counts = collections.Counter(r["step"] for r in rows)
    assert sorted(counts) == list(range(1, 11)) and counts[1] == counts[2] == 1 and counts[3] <= 2 and max(counts.values()) <= 2
    assert all(r.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE for r in rows), rows
    assert "sync/max_abs_logprob_diff" in rows[0] and "sync/max_abs_logprob_diff" in rows[-1]  # first, last
    log = caplog.text
    assert "train_group: 2 -> 1 devices" in log and "train_group: 1 -> 2 devices (devices joined)" in log
    assert "WholeModel actor is gone" not in log  # the control planes stayed: only Workhorses restarted
