"""Policy losses by name (`algorithms/core/registry.py`, `algorithms/policy_losses/`): GSPO and CISPO
against a transcription of veRL's `compute_policy_loss_gspo` / `compute_policy_loss_cispo`
(`verl/trainer/ppo/core_algos.py`, with its `agg_loss`) on random inputs, loss value, gradient
and clip fraction; `vanilla` as the PPO clip it was; the lookup, its error and the config
literal; and a `PolicyLoss(name="gspo")` unpickled and computed in a fresh process."""
import pickle
import subprocess
import sys
import typing

import pytest
import torch

from algorithms.core.masked import masked_mean
from algorithms.core.policy_loss import AGG_MODES, PolicyLoss
from algorithms.core.registry import (POLICY_LOSSES, policy_loss_fn, policy_loss_names, register_policy_loss)
from algorithms.policy_losses.vanilla import clipped_policy_loss
from xray.config.schema import PPOConfig
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.lengths import NORM, LossNorm

pytestmark = pytest.mark.unit

B, T = 6, 9


def _inputs(seed: int, spread: float = 0.3, dtype=torch.float64):
    """Random log-probs, old log-probs about `spread` apart, advantages, and a right-padded mask with
    rows of different lengths, one of them empty (a dropped sample)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    shift = torch.randn(B, 1, generator=g, dtype=dtype) * spread  # whole sequences move too (GSPO's ratio)
    logp = (old + shift + torch.randn(B, T, generator=g, dtype=dtype) * spread).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.tensor([9, 5, 1, 7, 0, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    weight = torch.rand(B, T, generator=g, dtype=dtype) * 2 * mask
    return logp, old, adv, mask, weight


# ---- a transcription of veRL's formulas (core_algos.py), written out independently ----

def verl_agg(mat, mask, mode):
    """veRL's `agg_loss` without data parallelism (dp_size 1, the micro-batch's own counts)."""
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    per_seq = (mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (mask.sum(-1) + 1e-8)
    keep = (mask.sum(-1) > 0).to(mat.dtype)
    return (per_seq * keep).sum() / keep.sum()


def verl_gspo(old, logp, adv, mask, low, high, weights=None, mode="seq-mean-token-mean"):
    """veRL's GSPO-token loss (veRL fixes the aggregation at seq-mean-token-mean)."""
    delta = logp - old
    seq = (delta * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=10.0)
    s = torch.exp(log_s)
    plain, clipped = -adv * s, -adv * torch.clamp(s, 1 - low, 1 + high)
    losses = torch.maximum(plain, clipped)
    if weights is not None:
        losses = losses * weights
    return verl_agg(losses, mask, mode), masked_mean(torch.gt(clipped, plain).to(mask.dtype), mask)


def verl_cispo(old, logp, adv, mask, low, high, weights=None, mode="token-mean"):
    """veRL's CISPO loss: the clipped ratio, detached, weighs -A * logp."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    bounded = torch.clamp(ratio, 1 - low, 1 + high)
    losses = -bounded.detach() * adv * logp
    if weights is not None:
        losses = losses * weights
    return verl_agg(losses, mask, mode), masked_mean((ratio != bounded).to(mask.dtype), mask)


def _compare(ours_fn, verl_fn, loss: PolicyLoss, seed: int, spread: float, weighted: bool, verl_mode: str):
    logp, old, adv, mask, weight = _inputs(seed, spread)
    w = weight if weighted else None
    ours, stats = ours_fn(logp, old, adv, mask, loss, w, None)
    (g_ours,) = torch.autograd.grad(ours, logp)
    high = loss.cliprange if loss.cliprange_high is None else loss.cliprange_high
    theirs, clipfrac = verl_fn(old, logp, adv, mask, loss.cliprange, high, w, verl_mode)
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    # veRL's seq-mean-token-mean divides by (tokens + 1e-8), xray's `aggregate` by tokens: 1e-8 relative
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(stats["clipfrac"], clipfrac, rtol=0, atol=1e-12)
    assert 0.0 < float(stats["clipfrac"]) < 1.0, "the inputs must exercise both sides of the clip"
    assert g_ours.abs().sum() > 0
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("clip", [(0.2, None), (0.2, 0.28), (3e-4, 4e-4)])
def test_gspo_equals_verl(seed, weighted, clip):
    low, high = clip
    spread = 0.3 if low > 0.01 else 3e-3  # the paper's tiny ranges need ratios that close to 1
    loss = PolicyLoss(name="gspo", cliprange=low, cliprange_high=high, loss_agg_mode="seq-mean-token-mean")
    _compare(policy_loss_fn("gspo"), verl_gspo, loss, seed, spread, weighted, "seq-mean-token-mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_gspo_aggregates_by_the_configured_mode(mode):
    """veRL always takes GSPO's seq-mean-token-mean; here `loss_agg_mode` decides, the per-token
    terms staying veRL's."""
    loss = PolicyLoss(name="gspo", cliprange=0.2, loss_agg_mode=mode)
    _compare(policy_loss_fn("gspo"), verl_gspo, loss, 3, 0.3, False, mode)


def test_gspo_one_ratio_per_sequence():
    """Every token of a response sees its sequence's ratio: the geometric mean of its tokens'."""
    logp, old, adv, mask, _ = _inputs(4)
    loss = PolicyLoss(name="gspo", cliprange=10.0)  # nothing clipped: the loss is -A * s_i per token
    out, stats = policy_loss_fn("gspo")(logp, old, adv, mask, loss, None, None)
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1).clamp(min=1))
    expected = ((-adv * s[:, None]) * mask).sum() / mask.sum()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert float(stats["clipfrac"]) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", [(0.2, None), (0.2, 0.28), (1.0, 0.28)])
def test_cispo_equals_verl(seed, weighted, mode, clip):
    low, high = clip
    loss = PolicyLoss(name="cispo", cliprange=low, cliprange_high=high, loss_agg_mode=mode)
    _compare(policy_loss_fn("cispo"), verl_cispo, loss, seed, 0.4, weighted, mode)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO's clip drops a clipped token's gradient; CISPO only bounds its weight."""
    logp = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)  # ratios e^0.5, e^-0.5
    old, adv, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1.0, -1.0]], dtype=torch.float64), \
        torch.ones(1, 2, dtype=torch.float64)
    out, stats = policy_loss_fn("cispo")(logp, old, adv, mask, PolicyLoss(name="cispo", cliprange=0.2), None, None)
    (grad,) = torch.autograd.grad(out, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 2, 0.8 / 2]], dtype=torch.float64))  # -sg(w) A / tokens
    assert float(stats["clipfrac"]) == 1.0
    vanilla, _ = clipped_policy_loss(logp, old, adv, mask, 0.2)
    (grad,) = torch.autograd.grad(vanilla, logp)
    assert grad.abs().max() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_is_the_ppo_clip_bit_for_bit(mode):
    logp, old, adv, mask, weight = _inputs(5, dtype=torch.float32)
    norm = LossNorm(tokens=17.0, rows=3.0)
    loss = PolicyLoss(cliprange=0.2, cliprange_high=0.28, loss_agg_mode=mode)
    assert loss.name == "vanilla"
    ours, stats = policy_loss_fn("vanilla")(logp, old, adv, mask, loss, weight, norm)
    direct, direct_stats = clipped_policy_loss(logp, old, adv, mask, 0.2, weight, 0.28, mode, norm)
    assert torch.equal(ours, direct) and all(torch.equal(stats[k], direct_stats[k]) for k in direct_stats)
    batch = Batch({C.LOSS_MASK: mask, C.OLD_LOGPROBS: old, C.ADVANTAGES: adv}, meta={NORM: norm})
    value, metrics = loss({C.LOGPROBS: logp}, batch)
    direct, direct_stats = clipped_policy_loss(logp, old, adv, mask, 0.2, None, 0.28, mode, norm)
    assert torch.equal(value, direct) and metrics["policy_clipfrac"] == float(direct_stats["clipfrac"])


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_every_loss_reports_the_shared_statistics(name):
    logp, old, adv, mask, _ = _inputs(6, dtype=torch.float32)
    batch = Batch({C.LOSS_MASK: mask, C.OLD_LOGPROBS: old, C.ADVANTAGES: adv})
    loss, metrics = PolicyLoss(name=name, max_approx_kl=1e-9)({C.LOGPROBS: logp}, batch)
    _, vanilla = PolicyLoss(max_approx_kl=1e-9)({C.LOGPROBS: logp}, batch)
    assert metrics["approx_kl"] == pytest.approx(vanilla["approx_kl"]) and metrics["approx_kl"] > 0
    assert metrics["ratio"] == pytest.approx(vanilla["ratio"])
    assert metrics["skipped"] == 1.0 and loss.item() == 0.0  # the guard applies to every loss


def test_lookup_error_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; choose one of cispo, gspo, vanilla"):
        policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="choose one of cispo, gspo, vanilla"):
        PolicyLoss(name="ppo2")  # fails where the loss is made, not on the engines


def test_registering_another_function_under_a_taken_name_is_an_error():
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        @register_policy_loss("gspo")
        def other(*args):
            return None
    assert POLICY_LOSSES["gspo"].__name__ == "gspo_policy_loss"


def test_the_config_literal_names_exactly_the_registered_losses():
    literal = typing.get_type_hints(PPOConfig)["policy_loss"]
    assert tuple(sorted(typing.get_args(literal))) == policy_loss_names() == ("cispo", "gspo", "vanilla")
    assert PPOConfig().policy_loss == "vanilla"


FRESH = """
import pickle, sys
loss, batch, logp = pickle.load(sys.stdin.buffer)
assert "algorithms.policy_losses.gspo" not in sys.modules, "the unpickling must not have imported it"
out, metrics = loss({"logprobs": logp}, batch)
assert "algorithms.policy_losses.gspo" in sys.modules
pickle.dump((out.detach(), metrics), sys.stdout.buffer)
"""


def test_a_pickled_gspo_loss_computes_in_a_fresh_process():
    """As on a Ray worker that only unpickled the loss: the lookup imports the registering module."""
    logp, old, adv, mask, _ = _inputs(7, dtype=torch.float32)
    loss = PolicyLoss(name="gspo", cliprange=0.2, loss_agg_mode="seq-mean-token-mean")
    batch = Batch({C.LOSS_MASK: mask, C.OLD_LOGPROBS: old, C.ADVANTAGES: adv})
    expected, metrics = loss({C.LOGPROBS: logp}, batch)
    payload = pickle.dumps((loss, batch, logp.detach()))
    done = subprocess.run([sys.executable, "-c", FRESH], input=payload, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out, fresh_metrics = pickle.loads(done.stdout)
    assert torch.equal(out, expected.detach()) and fresh_metrics == metrics
    assert pickle.loads(pickle.dumps(loss)) == loss
