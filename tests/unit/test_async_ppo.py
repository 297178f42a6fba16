"""Asynchronous PPO's pure parts: the decoupled loss and the experience buffer's staleness policy."""
import pytest
import torch

from algorithms.ppo.buffer import ExperienceBuffer, maker_must_wait
from algorithms.ppo.losses import PolicyLoss, behaviour_weight
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


def test_buffer_drops_what_is_too_stale_and_keeps_order():
    buf = ExperienceBuffer(capacity=3, max_staleness=1)
    for item, version in (("a", 0), ("b", 1), ("c", 2)):
        buf.put(item, version)
    assert buf.full()
    with pytest.raises(RuntimeError, match="full"):
        buf.put("d", 2)
    assert buf.take(trainer_version=1) == ("a", 0, 1)
    assert buf.take(trainer_version=3) == ("c", 2, 1)  # "b" was 2 versions old: dropped
    assert buf.dropped == 1 and buf.take(trainer_version=3) is None
    assert buf.stats()["async/buffer_fill"] == 0.0
    with pytest.raises(ValueError):
        ExperienceBuffer(capacity=0, max_staleness=1)


def test_wait_policy_on_a_scripted_sequence_of_versions():
    # (trainer version, maker version) as a run goes: pushes bring the maker up to date
    script = [(0, 0), (1, 0), (2, 0), (2, 2), (3, 2), (4, 2)]
    waits = [maker_must_wait("wait", t, m, max_staleness=1) for t, m in script]
    assert waits == [False, False, True, False, False, True]
    assert not any(maker_must_wait("drop", t, m, max_staleness=1) for t, m in script)
