"""Experience outlives the maker that made it (`xray/run/detached/buffer.py`): a maker puts a scored
batch by naming it to the buffer, which calls for it (`ExperienceMaker.hand_over`), so the object is
the result of the buffer's call and the buffer owns it; a group queued in the buffer is still
fetched after its maker was killed. A group whose experience is gone all the same (put as makers did
before, `ray.put` by the maker, which died) is given back by the trainer's take (`take_experience`),
its prompt made again by another maker, and the take completes with the group fetched first in
line. Real Ray actors, a real `BufferActor`, `ray.kill`.
"""
import asyncio
import time

import pytest
import torch

from xray.data import columns as C
from xray.data.batch import Batch
from xray.run.detached.buffer import BufferActor, Group, take_experience

pytestmark = pytest.mark.ray


class Putter:
    """A maker's put (`ExperienceMaker._put` and `hand_over`): a scored batch, its group into the buffer."""

    def __init__(self):
        self.outbox = {}

    async def put(self, buffer, key: int, row: dict, owned: bool) -> None:
        import ray

        batch = Batch({C.SCORES: torch.full((2,), float(row["n"])), C.INPUT_IDS: torch.zeros(2, 40_000)})
        if owned:  # as a maker puts now: the buffer calls for it and owns it
            self.outbox[key] = batch
            me = ray.get_runtime_context().current_actor
            await buffer.put.remote([Group([None, 0, 2], 0, 0, 4, row, key)], me, key)
        else:  # as makers put before: `ray.put` here, owned by this actor
            ref = ray.put(batch)
            await buffer.put.remote([Group([ref, 0, 2], 0, 0, 4, row, key)])
            return [ref]

    def hand_over(self, serial: int):
        return self.outbox.pop(serial)

    def held(self) -> int:
        return len(self.outbox)


class Sampler:
    """Numbered prompt rows, two a draw."""

    def __init__(self):
        self.n = 0

    def next_indices(self) -> list[int]:
        self.n += 2
        return [self.n - 2, self.n - 1]


class Prompts:
    def rows(self, indices):
        return [{"n": i} for i in indices]


def test_a_killed_makers_queued_group_survives_and_a_lost_one_is_made_again(local_ray):
    import ray

    buffer = ray.remote(BufferActor).remote(Prompts(), Sampler(), 2, [[0], [0]], 2, "wait", 4, 0)
    doomed, survivor = ray.remote(Putter).remote(), ray.remote(Putter).remote()
    (k0, r0), (k1, r1) = ray.get(buffer.lease.remote(0, 2, 0))
    ray.get(doomed.put.remote(buffer, k0, r0, owned=True))  # as a maker puts now
    [unowned] = ray.get(doomed.put.remote(buffer, k1, r1, owned=False))  # as makers put before
    while ray.get(doomed.held.remote()):  # until the buffer's call for the first batch has run
        time.sleep(0.01)
    ray.kill(doomed)  # the maker is lost with both groups queued
    deadline = time.monotonic() + 60
    while True:  # until the kill has landed: a call sent right after it may still run before it
        try:
            ray.get(doomed.held.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed maker still answers"
        time.sleep(0.05)
    while True:  # until Ray has freed what the dead maker owned (it learns of the death in its own time)
        try:
            ray.get(unowned, timeout=10)
        except ray.exceptions.OwnerDiedError:
            break
        assert time.monotonic() < deadline, "the dead maker's own object was never freed"
        time.sleep(0.1)
    assert ray.get(buffer.requeue.remote(0)) == 0  # nothing was in the making

    async def take_while_the_survivor_makes_it_again():
        taking = asyncio.ensure_future(take_experience(buffer, 0))
        for _ in range(1500):  # until the take gave it back
            if (await buffer.stats.remote())["async/requeued_lost"] >= 1:
                break
            await asyncio.sleep(0.02)
        again = await buffer.lease.remote(1, 1, 0, wait=False)  # first in line
        assert again[0][1] == r1
        await survivor.put.remote(buffer, again[0][0], again[0][1], owned=True)
        return await asyncio.wait_for(taking, 60)

    taken, batches = asyncio.run(take_while_the_survivor_makes_it_again())
    assert [g.row["n"] for g in taken[0]] == [0, 1]  # the surviving group first, the one made again next
    assert [b[C.SCORES].tolist() for b in batches[0]] == [[0.0, 0.0], [1.0, 1.0]]
    assert taken[0][1].key != k1  # a new lease: made again, not the lost object
    stats = ray.get(buffer.stats.remote())
    assert stats["async/requeued_lost"] == 1.0 and stats["async/buffer_fill"] == 0.0
