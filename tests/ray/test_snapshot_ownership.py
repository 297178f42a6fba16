"""A flash snapshot lives once in host memory, owned by its model's WholeModel actor.

On the real pretrained model (SmolLM2-135M-Instruct, a Megatron critic in fp32: 1.5 GiB of weights
and AdamW moments to copy), after a train step: each snapshot taken and handed over
(`WholeModel.hand_snapshot`, right behind the copy) leaves the Workhorse's own memory where it was (the Workhorse kept
each copy before, and held 3.0 GiB more after two: measured 2.3 -> 5.3 GiB), the WholeModel actor
keeps the newest two (`kept_snapshot`: what a trainer taking over from a dead one reads), a disk
write reads the handed answer in place, and the answer outlives the Workhorse: after it is killed
the model restarts and restores it from memory to the same values, bit for bit.
"""
import asyncio

import pytest
import torch

from xray.check import reference as R
from xray.config.parallel import ParallelDims
from xray.data import columns as C
from xray.wholemodel import WholeModel
from xray.workhorse.train import TrainWorkhorse

pytestmark = pytest.mark.ray
GIB = 2 ** 30


def value_loss(outputs, mb):
    mask = mb[C.LOSS_MASK]
    loss = ((outputs[C.VALUES] - 0.5) ** 2 * mask).sum() / mask.sum()
    return loss, {"value_loss": float(loss.detach())}


def anon_bytes(workhorse) -> int:
    import ray

    pid = ray.get(workhorse.pid.remote())
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_a_snapshot_is_handed_over_not_kept_and_outlives_its_workhorse(local_ray, smollm2, tmp_path):
    critic = WholeModel(TrainWorkhorse, role="critic", parallel=ParallelDims(),
                        init_kwargs=dict(backend="megatron", model_dir=str(smollm2)))
    try:
        batch = R.random_batch(4, 96, 49152, seed=0)
        asyncio.run(_steps(critic, batch, tmp_path))
    finally:
        critic.shutdown()


async def _steps(critic, batch, tmp_path):
    import ray

    await critic.train_step(batch, value_loss, 2)
    base = anon_bytes(critic.shard_handles()[0])
    directories = [str(tmp_path / f"step-{i}" / "critic") for i in range(3)]
    handed = []
    for directory in directories:
        copy = critic.snapshot(directory, directory)
        await critic.hand_snapshot(directory, directory, copy)  # submitted right behind the copy
        handed.append(await critic.handed_snapshot(directory))
        grown = anon_bytes(critic.shard_handles()[0]) - base
        assert grown < 0.5 * GIB, f"the Workhorse grew {grown / GIB:.2f} GiB with its snapshots (one copy: 1.5 GiB)"
    assert await critic.kept_snapshot(directories[0]) is None
    assert await critic.kept_snapshot(directories[2]) == (critic.parallel, handed[2])

    critic.persist_snapshot(directories[2], handed[2])
    assert await critic.wait_persisted()
    on_disk = sorted(p.name for p in (tmp_path / "step-2" / "critic").rglob("*") if p.is_file())
    assert on_disk, "the handed snapshot was not written"

    want = (await critic.forward(batch))[C.VALUES]
    await critic.train_step(batch, value_loss, 2)  # moves the weights past the snapshot
    ray.kill(critic.shard_handles()[0])
    critic.restart()
    assert await critic.load(directories[2], handed[2]) == "memory"
    got = (await critic.forward(batch))[C.VALUES]
    assert torch.equal(got, want)


def test_one_node_starts_no_replica_holder(local_ray):
    """A replica's holder is a process with torch imported: on one node there is nowhere else to
    put a copy, and none is started (`Replicator.refresh`)."""
    from xray.run.snapshot_holder import Replicator

    replicas = Replicator()
    assert replicas.refresh() == 1 and replicas.holders == {}
