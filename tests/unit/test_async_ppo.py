"""Asynchronous PPO's pure parts: the decoupled loss, the experience buffer's staleness policy and
routing, the maker/trainer graph, and each trainer's share of the mini-batches."""
import pytest
import torch

from algorithms.ppo.buffer import Entry, ExperienceBuffer, maker_must_wait
from algorithms.ppo.losses import PolicyLoss, behaviour_weight
from algorithms.ppo.trainer import mini_batch_rows
from xray.config.graph import build_graph
from xray.config.typed import ConfigError
from xray.data import columns as C
from xray.data.batch import Batch

pytestmark = pytest.mark.unit


def batch(old, behaviour, advantages, mask):
    return Batch({C.OLD_LOGPROBS: old, C.BEHAVIOUR_LOGPROBS: behaviour, C.ADVANTAGES: advantages, C.LOSS_MASK: mask})


def test_decoupled_loss_is_the_synchronous_loss_at_staleness_0():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g)
    new = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    b = batch(old, old.clone(), adv, mask)  # the behaviour policy is the proximal one
    sync_loss, _ = PolicyLoss(cliprange=0.2)({C.LOGPROBS: new}, b)
    async_loss, metrics = PolicyLoss(cliprange=0.2, behaviour_weight_cap=2.0)({C.LOGPROBS: new}, b)
    assert torch.equal(sync_loss, async_loss) and metrics["behaviour_weight"] == 1.0
    (g_sync,) = torch.autograd.grad(sync_loss, new)
    (g_async,) = torch.autograd.grad(async_loss, new)
    assert torch.equal(g_sync, g_async)
    assert C.BEHAVIOUR_LOGPROBS in PolicyLoss(behaviour_weight_cap=2.0).reads
    assert C.BEHAVIOUR_LOGPROBS not in PolicyLoss().reads


def test_truncated_weight_per_token():
    proximal = torch.log(torch.tensor([[0.5, 0.5, 0.9, 0.2]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = behaviour_weight(proximal, behaviour, mask, cap=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 3.0, 0.0]]))  # ratio 1, 2, 9 -> capped at 3; off the mask 0
    adv = torch.ones(1, 4)
    loss, _ = PolicyLoss(cliprange=10.0, behaviour_weight_cap=3.0)(
        {C.LOGPROBS: proximal}, batch(proximal, behaviour, adv, mask))
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 3.0) / 3)  # ratio 1 at the proximal policy: -A x w


def entry(item, version, index, maker=0):
    return Entry(item, version, maker, serial=ord(item), index=index)


def test_buffer_takes_in_claimed_order_and_drops_what_is_too_stale():
    buf = ExperienceBuffer(capacity=3, max_staleness=1)
    buf.put(entry("b", 1, index=2), 0)  # finished first, claimed second
    assert buf.take(trainer_version=0) == (None, [0])  # index 1 is still being made
    buf.put(entry("a", 0, index=1), 0)
    buf.put(entry("c", 1, index=3), 0)
    with pytest.raises(RuntimeError, match="full"):
        buf.put(entry("d", 2, index=4), 0)
    assert buf.take(trainer_version=0) == ([(entry("a", 0, 1), 0)], [0])
    assert buf.take(trainer_version=3) == (None, [2])  # "b" and "c" are 2 versions old: dropped
    assert buf.dropped == 2 and buf.expected == [4]
    buf.put(entry("d", 2, index=4), 0)
    assert buf.take(trainer_version=3) == ([(entry("d", 2, 4), 1)], [0])
    with pytest.raises(RuntimeError, match="already trained"):
        buf.put(entry("e", 3, index=2), 0)
    assert buf.stats()["async/buffer_fill"] == 0.0
    with pytest.raises(ValueError):
        ExperienceBuffer(capacity=0, max_staleness=1)


def test_buffer_takes_one_entry_per_trainer():
    buf = ExperienceBuffer(capacity=2, max_staleness=0, trainers=2)
    buf.put(entry("a", 0, index=1, maker=0), 0)
    assert buf.take(0) == (None, [0, 0]) and len(buf.queues[0]) == 1  # trainer 1 has nothing: nothing taken
    buf.put(entry("b", 0, index=1, maker=1), 1)
    assert buf.take(0) == ([(entry("a", 0, 1), 0), (entry("b", 0, 1, maker=1), 0)], [0, 0])
    assert [t for t, _ in buf.entries()] == []


def test_graph_defaults_names_and_errors():
    g = build_graph({}, {}, makers=2, trainers=2)
    assert g.feeds == ((0, 1), (0, 1)) and g.pusher == (0, 1) and g.pushed_by(1) == [1]
    g = build_graph({"maker0": ["trainer0"], "maker1": ["trainer1", "trainer0"]}, {"trainer1": ["maker0", "maker1"]}, 2, 2)
    assert g.feeds == ((0,), (0, 1)) and g.pusher == (1, 1) and g.pushed_by(0) == []
    for feeds, pushes, match in (({"maker2": ["trainer0"]}, {}, "maker0..maker1"),
                                 ({"maker0": ["trainer0"], "maker1": ["trainer0"]}, {}, "trainer1 is fed by no maker"),
                                 ({"maker0": []}, {}, "empty"),
                                 ({}, {"trainer0": ["maker0"], "trainer1": ["maker0"]}, "under one trainer"),
                                 ({}, {"trainer5": ["maker0"]}, "trainer0..trainer1")):
        with pytest.raises(ConfigError, match=match):
            build_graph(feeds, pushes, 2, 2)


def test_each_replica_trains_on_its_own_part():
    rows = mini_batch_rows(16, mini_batch_size=8, parts=2, seed=3)
    assert len(rows) == 2 and sorted(torch.cat(rows).tolist()) == list(range(16))
    for mb in rows:  # dp=2 splits a mini-batch in halves: the first from part 0, the second from part 1
        assert all(r < 8 for r in mb[:4].tolist()) and all(r >= 8 for r in mb[4:].tolist())
    order = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    assert [r.tolist() for r in mini_batch_rows(16, 8, 1, 3)] == [order[:8].tolist(), order[8:].tolist()]


def test_wait_policy_on_a_scripted_sequence_of_versions():
    # (index claimed: the trainer step that trains on it, from version index - 1; maker's version)
    script = [(1, 0), (2, 0), (3, 0), (3, 2), (4, 2), (5, 2)]
    waits = [maker_must_wait("wait", j, m, max_staleness=1) for j, m in script]
    assert waits == [False, False, True, False, False, True]
    assert not any(maker_must_wait("drop", j, m, max_staleness=1) for j, m in script)
