"""Clipped policy and value losses: hand-computed values, gradients, and the picklable LossFns."""
import math
import pickle

import pytest
import torch

from algorithms.core.policy_loss import PolicyLoss, aggregate
from algorithms.policy_losses.vanilla import clipped_policy_loss
from algorithms.ppo.value_loss import ValueLoss, clipped_value_loss
from xray.data import columns as C
from xray.data.batch import Batch

pytestmark = pytest.mark.unit

# four response positions and one masked position holding garbage that must be ignored
MASK = torch.tensor([[1., 1., 1., 1., 0.]])
RATIO = [1.5, 0.5, 1.1, 0.7]
ADV = torch.tensor([[1.0, 1.0, -2.0, -1.0, 100.0]])


def _logp():
    return torch.tensor([[math.log(r) for r in RATIO] + [5.0]], requires_grad=True)


def test_policy_loss_hand_computed_with_gradient():
    logp = _logp()
    loss, stats = clipped_policy_loss(logp, torch.zeros(1, 5), ADV, MASK, cliprange=0.2)
    # max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 2.2, 0.8 (clipped) -> mean 0.325
    assert loss.item() == pytest.approx(0.325, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    k3 = [(r - 1) - math.log(r) for r in RATIO]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert stats["ratio"].item() == pytest.approx(sum(RATIO) / 4, abs=1e-6)
    loss.backward()
    # clipped positions get no gradient; others -A * r / 4
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, 0.55, 0.0, 0.0]]), rtol=0, atol=1e-6)


def test_value_loss_hand_computed():
    values = torch.tensor([[0.5, -0.1, 0.3, 1.0, 7.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0, -7.0]])
    loss, stats = clipped_value_loss(values, torch.zeros(1, 5), returns, MASK, cliprange_value=0.2)
    # max sq errors: 0.64 (clipped), 1.21, 0.09, 1.0 -> 0.5 * 2.94 / 4
    assert loss.item() == pytest.approx(0.3675, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.25)
    assert stats["values"].item() == pytest.approx(0.425, abs=1e-6)


def _batch():
    return Batch({C.OLD_LOGPROBS: torch.zeros(1, 5), C.ADVANTAGES: ADV, C.LOSS_MASK: MASK,
                  C.OLD_VALUES: torch.zeros(1, 5), C.RETURNS: torch.tensor([[1.0, 1.0, 0.0, 0.0, -7.0]])})


def test_loss_fns_read_columns_report_floats_and_pickle():
    policy = pickle.loads(pickle.dumps(PolicyLoss(cliprange=0.2)))
    value = pickle.loads(pickle.dumps(ValueLoss(0.2, 0.1)))
    assert policy == PolicyLoss(0.2) and value == ValueLoss(cliprange_value=0.2, vf_coef=0.1)
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    loss, metrics = policy({C.LOGPROBS: _logp(), C.ENTROPY: entropy}, _batch())
    assert loss.item() == pytest.approx(0.325, abs=1e-6)
    assert metrics["policy_loss"] == pytest.approx(0.325, abs=1e-6) and metrics["policy_clipfrac"] == 0.5
    assert metrics["entropy"] == pytest.approx(2.5)
    assert all(isinstance(v, float) for v in metrics.values())
    vloss, vmetrics = value({C.VALUES: torch.tensor([[0.5, -0.1, 0.3, 1.0, 7.0]])}, _batch())
    assert vloss.item() == pytest.approx(0.03675, abs=1e-7)  # vf_coef * value_loss
    assert vmetrics["value_loss"] == pytest.approx(0.3675, abs=1e-6) and vmetrics["value_clipfrac"] == 0.25


def test_wide_cliprange_is_plain_policy_gradient():
    logp = _logp()
    loss, stats = clipped_policy_loss(logp, torch.zeros(1, 5), ADV, MASK, cliprange=10.0)
    assert stats["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 2.2 + 0.7) / 4, abs=1e-6)


def test_clip_higher_lets_positive_advantages_rise_further():
    """DAPO's clip-higher: ratio 1.5 with A=1 is clipped at 1 + 0.28 instead of 1.2; the low side
    (ratio 0.7, A=-1) stays clipped at 0.8."""
    loss, stats = clipped_policy_loss(_logp(), torch.zeros(1, 5), ADV, MASK, cliprange=0.2, cliprange_high=0.28)
    # -1.28 (clipped high), -0.5, 2.2, 0.8 (clipped low) -> mean 0.305
    assert loss.item() == pytest.approx(0.305, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.5)


def test_loss_aggregation_modes_hand_computed():
    terms = torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1., 1., 1., 0.], [1., 0., 0., 0.], [0., 0., 0., 0.]])  # row 2 dropped
    assert aggregate(terms, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(terms, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(terms, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(terms, torch.zeros(3, 4), "seq-mean-token-sum").item() == 0.0
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate(terms, mask, "sum")


def test_kl_loss_term_and_the_skip_guard():
    ref = torch.tensor([[0.0, -1.0, 0.5, 0.0, 0.0]])  # d = ref - logp on the mask
    batch = Batch({C.LOSS_MASK: MASK, C.OLD_LOGPROBS: torch.zeros(1, 5), C.ADVANTAGES: ADV, C.REF_LOGPROBS: ref})
    with_kl = PolicyLoss(cliprange=0.2, kl_coef=0.5, kl_estimator="k3")
    assert C.REF_LOGPROBS in with_kl.reads and C.REF_LOGPROBS not in PolicyLoss().reads
    logp = _logp()
    loss, metrics = with_kl({C.LOGPROBS: logp}, batch)
    d = [0.0 - math.log(RATIO[0]), -1.0 - math.log(RATIO[1]), 0.5 - math.log(RATIO[2]), -math.log(RATIO[3])]
    k3 = sum(math.exp(x) - x - 1 for x in d) / 4
    assert metrics["kl_loss"] == pytest.approx(k3, abs=1e-5)
    assert loss.item() == pytest.approx(0.325 + 0.5 * k3, abs=1e-5)
    # approx KL here is 0.0872: a bound of 0.05 skips the micro-batch (no gradient), 0.1 does not
    guarded = PolicyLoss(cliprange=0.2, max_approx_kl=0.05)
    loss, metrics = guarded({C.LOGPROBS: logp}, batch)
    assert metrics["skipped"] == 1.0 and metrics["approx_kl"] == pytest.approx(0.0872, abs=1e-4)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    _, metrics = PolicyLoss(cliprange=0.2, max_approx_kl=0.1)({C.LOGPROBS: _logp()}, batch)
    assert metrics["skipped"] == 0.0


def test_on_policy_loss_reads_no_old_logprobs_and_is_the_policy_gradient():
    logits = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss_fn = PolicyLoss(on_policy=True)
    assert C.OLD_LOGPROBS not in loss_fn.reads and C.ADVANTAGES in loss_fn.reads
    loss, metrics = loss_fn({C.LOGPROBS: logits}, {C.LOSS_MASK: mask, C.ADVANTAGES: adv})
    assert metrics["ratio"] == 1.0 and metrics["approx_kl"] == 0.0 and metrics["policy_clipfrac"] == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.0 + 3.0 + 1.0) / 5)  # -mean(A) at ratio 1
    loss.backward()
    torch.testing.assert_close(logits.grad, -adv * mask / 5)  # d/dlogp of -A * ratio: -A / tokens
