"""Elastic SFT, the DLRover seed's job: a device lost and returned mid-run, compared by numbers.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`), each offering one device of the
actor's group (the custom resource `xray_trainer`). `python -m xray.train sft`'s job
(`sft_command`, in this process so the test can move the nodes) trains the actor at dp=2 with the
seed's `elasticity` block (ms-swift's, `tests/unit/test_deepspeed_elastic_rule.py`: DeepSpeed v0.1,
one global batch of 8 at 1, 2 and 4 devices), but `min_time: 0` so that the group may grow back at
once (the seed's 20 minutes would outlast the test). Per training backend (Megatron and DeepSpeed
ZeRO-2 training LoRA adapters, as the seed does; ZeRO-1 and ZeRO-3 every weight): one
uninterrupted run, and one whose second node leaves once step 2 is logged (the group shrinks to one
device, restored from the newest snapshot in memory, resharded: the step in flight runs again with
micro-batch 4 x 2 accumulation steps) and returns once step 4 is logged (step 5 waits until Ray has
added it; the group grows back at that step boundary from step 4's snapshot). Each step's loss and
the final weights equal the uninterrupted run's to fp32 summation order (the global batch, the
data and the lr are the same at both sizes; measured: equal bit for bit).
"""
import asyncio
import json
import logging
import queue
import re
import threading
import time
from unittest import mock

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.e2e.test_ppo_e2e import ROOT
from tests.unit.test_deepspeed_elastic_rule import SEED_BLOCK

pytestmark = [pytest.mark.ray, pytest.mark.slow]
WORKER = {"num_cpus": 2, "resources": {"xray_trainer": 1}}
STEPS = 6
LOSS_RTOL = 1e-4
"""Per step, faulted against uninterrupted: the same batch summed in another order (fp32)."""
WEIGHT_ATOL = 2e-5
"""Final weights: six Adam steps at lr 1e-3 from gradients equal to rounding."""


class NodeThread:
    """The one thread that adds the worker node, alive for the module: a node's processes die with
    the thread that started them (Linux's parent-death signal follows the thread, and Ray sets it),
    and the job runs in the main thread (its signal handling needs it)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, done = job
            try:
                done.put(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.put(exc)

    def call(self, fn):
        done: queue.Queue = queue.Queue()
        self.jobs.put((fn, done))
        if isinstance(out := done.get(), BaseException):
            raise out
        return out

    def add_worker(self, cluster) -> None:
        def add() -> None:  # Ray's node object sets a SIGTERM handler, which only the main thread may
            with mock.patch("ray._private.utils.set_sigterm_handler", lambda handler: None):
                cluster.add_node(**WORKER)
        self.call(add)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


@pytest.fixture(scope="module")
def two_nodes():
    """The head (one train device) and a worker node (the other), for this module, with the thread
    that adds the worker."""
    import ray
    from ray.cluster_utils import Cluster

    from xray.wholemodel.cluster import bind_loopback, ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    bind_loopback()
    nodes = NodeThread()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"xray_trainer": 1}})
    nodes.add_worker(cluster)
    cluster.wait_for_nodes()
    ensure_ray(address=cluster.address)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()
    nodes.close()


def sft_config(tmp_path, model_dir, backend: str, zero: int | None, lora: bool) -> str:
    cfg = yaml.safe_load((ROOT / "configs/ppo_tiny_cpu.yaml").read_text())
    cfg["model"]["path"] = str(model_dir)
    cfg["device_groups"] = {"nproc_per_node": 2, "train_group": {
        "device": "CPU", "ranks": [0, 1], "workers": ["actor"], "resources": {"xray_trainer": 1}}}
    cfg["actor"].update(tp=1, dp=2, elasticity={**SEED_BLOCK, "min_time": 0})
    if zero is not None:
        cfg["actor"]["zero_stage"] = zero
    if lora:
        cfg["actor"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg["sft"] = {"steps": STEPS, "batch_size": 8, "lr": 1e-3, "warmup_steps": 0}
    cfg["trainer"].update(save_every=0, log_every=1, max_restarts=1, loggers=["jsonl"])
    path = tmp_path / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def losses(run) -> dict[int, float]:
    """Each step's loss as last logged (a step run again is logged again)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["sft_loss"] for r in rows}


def move_nodes(cluster, nodes: NodeThread, run, events: list, stop: threading.Event) -> None:
    """Remove the worker node once step 2 is logged, add it back once step 4 is (threads: the job's
    loop runs in the test's own thread)."""
    for after, change in ((2, "removed"), (4, "added")):
        while not stop.is_set():
            path = run / "metrics.jsonl"
            if path.exists() and any(json.loads(line)["step"] >= after for line in path.read_text().splitlines()):
                break
            time.sleep(0.01)
        if stop.is_set():
            return
        if change == "removed":
            cluster.remove_node(next(iter(cluster.worker_nodes)))
        else:
            nodes.add_worker(cluster)
        events.append(change)


@pytest.mark.parametrize("backend, zero, lora", [("megatron-vllm", None, True), ("deepspeed-dsinfer", 1, False),
                                                  ("deepspeed-dsinfer", 2, True), ("deepspeed-dsinfer", 3, False)],
                         ids=["megatron-lora", "zero1", "zero2-lora", "zero3"])
def test_a_device_lost_and_returned_changes_no_number(tmp_path, tiny_model, two_nodes, backend, zero, lora, caplog):
    cluster, nodes = two_nodes
    from algorithms.sft import sft_command
    from xray.run.supervised import SupervisedTrainer
    from xray.train import resolve

    path = sft_config(tmp_path, tiny_model, backend, zero, lora)
    _, cfg, plan, _, _ = resolve(["sft", "--backend", backend, "--config", path])
    caplog.set_level(logging.WARNING)
    whole = sft_command(cfg, plan, tmp_path / "whole", cluster.address)
    events: list = []
    stop = threading.Event()
    mover = threading.Thread(target=move_nodes, args=(cluster, nodes, tmp_path / "faulted", events, stop), daemon=True)
    mover.start()
    step = SupervisedTrainer.step

    async def paced(self, n: int) -> dict:  # step 5 waits for the node to be back (Ray takes seconds to add it),
        while n == 5 and len(events) < 2 and not stop.is_set():  # and ends once the processes for the grow
            await asyncio.sleep(0.05)  # are warm there (`Models.warm_joined`): the run grows for step 6
        metrics = await step(self, n)
        deadline = time.monotonic() + 120
        while n == 5 and not stop.is_set() and time.monotonic() < deadline and not await asyncio.to_thread(
                self.models.warm_joined, "train_group"):
            await asyncio.sleep(0.05)
        return metrics
    try:
        with mock.patch.object(SupervisedTrainer, "step", paced):
            faulted = sft_command(cfg, plan, tmp_path / "faulted", cluster.address)
    finally:
        stop.set()
        mover.join()
        if not cluster.worker_nodes:  # the next test starts with both nodes
            nodes.add_worker(cluster)
    log = caplog.text
    assert events == ["removed", "added"], (events, log[-3000:])
    assert "train_group: 2 -> 1 devices" in log and "train_group: 1 -> 2 devices (devices joined)" in log, log[-3000:]
    # the head's device stood: its Workhorse kept its process through both resizes (`Workhorse.rejoin`)
    assert re.search(r"train_group: 2 -> 1 devices .*; 1 of 1 Workhorses kept their processes", log), log[-3000:]
    assert "train_group: 1 -> 2 devices (devices joined); actor dp 2, mini-batch 8, actor micro-batch 4; 1 of 2 " \
           "Workhorses kept their processes" in log, log[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "faulted/metrics.jsonl").read_text().splitlines()]
    sizes = [r["elastic/train_group_devices"] for r in rows]
    assert 1.0 in sizes and sizes[-1] == 2.0 and all(r["elastic/mini_batch_size"] == 8.0 for r in rows), rows
    # at most the step in flight ran again; on DeepSpeed, whose restore at another size needs every
    # rank's files, the step before too when the lost node's copy of the newest snapshot was still
    # being replicated (the one before it was: the log names it)
    assert len(rows) <= STEPS + (1 if backend.startswith("megatron") else 2), rows
    got, want = losses(tmp_path / "faulted"), losses(tmp_path / "whole")
    assert sorted(got) == list(range(1, STEPS + 1)) and want[STEPS] < want[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), (step, got, want)
    a, b = load_file(str(next(faulted.glob("*.safetensors")))), load_file(str(next(whole.glob("*.safetensors"))))
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= WEIGHT_ATOL, worst
    moved = max(float((b[k].float() - t.float()).abs().max()) for k, t in initial(tiny_model, lora, b).items())
    assert moved > 50 * WEIGHT_ATOL, moved  # the comparison can see a step's update


def initial(model_dir, lora: bool, trained: dict) -> dict[str, torch.Tensor]:
    """The tensors the job started from, for the names of `trained` (a LoRA adapter: zeros, as its
    B matrices start)."""
    if lora:
        return {k: torch.zeros_like(v) for k, v in trained.items() if "lora_B" in k}
    start = {}
    for f in model_dir.glob("*.safetensors"):
        start.update(load_file(str(f)))
    return {k: start[k] for k in trained}
