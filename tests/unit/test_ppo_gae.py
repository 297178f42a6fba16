"""GAE over masked response spans and masked whitening, against hand-computed values and a
per-row transcription of trlX's loop."""
import math

import pytest
import torch

from algorithms.core.masked import masked_mean, masked_var, whiten
from algorithms.ppo.gae import gae

pytestmark = pytest.mark.unit


def test_gae_hand_computed():
    # position 0 is the prompt, position 4 padding: their rewards and values must be ignored
    mask = torch.tensor([[0., 1., 1., 1., 0.]])
    rewards = torch.tensor([[5.0, 1.0, 0.0, 2.0, 7.0]])
    values = torch.tensor([[9.0, 0.5, 1.0, 1.5, 9.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # A3 = 2 - 1.5 = 0.5; A2 = 0.9*1.5 - 1 + 0.72*0.5 = 0.71; A1 = 1 + 0.9 - 0.5 + 0.72*0.71 = 1.9112
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.9112, 0.71, 0.5, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 2.4112, 1.71, 2.0, 0.0]]), rtol=0, atol=1e-6)


def test_gae_gamma_lam_one_is_return_to_go_minus_value():
    mask = torch.tensor([[0., 1., 1., 1., 0.]])
    adv, ret = gae(torch.tensor([[0., 1., 0., 2., 0.]]), torch.tensor([[0., 0.5, 1.0, 1.5, 0.]]), mask, 1.0, 1.0)
    assert adv.tolist() == [[0.0, 2.5, 1.0, 0.5, 0.0]]
    assert ret.tolist() == [[0.0, 3.0, 2.0, 2.0, 0.0]]


def _trlx_gae(values, rewards, gamma, lam):
    """trlX's `get_advantages_and_returns` on one unpadded response (without whitening)."""
    last, out = 0.0, []
    n = values.shape[1]
    for t in reversed(range(n)):
        next_v = values[:, t + 1] if t < n - 1 else 0.0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def test_gae_matches_trlx_loop_row_by_row():
    g = torch.Generator().manual_seed(0)
    spans = [(2, 7), (0, 3), (5, 9), (1, 2)]
    mask = torch.zeros(4, 9)
    for i, (s, e) in enumerate(spans):
        mask[i, s:e] = 1
    rewards, values = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    for i, (s, e) in enumerate(spans):
        a, r = _trlx_gae(values[i:i + 1, s:e], rewards[i:i + 1, s:e], 0.97, 0.9)
        torch.testing.assert_close(adv[i:i + 1, s:e], a, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ret[i:i + 1, s:e], r, rtol=1e-6, atol=1e-6)
    assert adv[mask == 0].abs().max() == 0 and ret[mask == 0].abs().max() == 0


def test_whiten_masked_unbiased():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1., 1., 0.], [1., 1., 0.]])
    std = math.sqrt(5.0 / 3.0 + 1e-8)  # mean 2.5, unbiased variance 5/3
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.0], [0.5 / std, 1.5 / std, 0.0]])
    torch.testing.assert_close(whiten(x, mask), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), (expected + 2.5) * mask, rtol=0, atol=1e-6)
    # equals torch.var_mean's whitening when nothing is masked (trlX's whiten)
    y = torch.randn(3, 4)
    var, mean = torch.var_mean(y)
    torch.testing.assert_close(whiten(y, torch.ones(3, 4)), (y - mean) * torch.rsqrt(var + 1e-8))



def test_whiten_floor_keeps_a_nearly_uniform_batch_small():
    """Every sample right: only noise of 1e-3 is left. Plain whitening blows it up to unit
    variance; with min_std 0.1 it stays at a hundredth of that."""
    noise = torch.tensor([[1e-3, -1e-3, 2e-3, -2e-3]])
    mask = torch.ones(1, 4)
    assert whiten(noise, mask).abs().max().item() > 1.0
    floored = whiten(noise, mask, min_std=0.1)
    torch.testing.assert_close(floored, noise / 0.1, rtol=1e-5, atol=1e-7)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # a real spread: the floor changes nothing
    torch.testing.assert_close(whiten(x, mask, min_std=0.1), whiten(x, mask))


def test_masked_stats():
    x = torch.tensor([[1.0, 5.0], [3.0, 100.0]])
    mask = torch.tensor([[1., 1.], [1., 0.]])
    assert masked_mean(x, mask).item() == 3.0
    assert masked_mean(x, mask, dim=1).tolist() == [3.0, 3.0]
    assert masked_var(x, mask).item() == pytest.approx(4.0)           # (4 + 4 + 0) / 2
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(8.0 / 3.0)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.tensor([[1., 0.], [0., 0.]]))


def test_gae_skips_a_multi_turn_episodes_observations():
    """Holes in the mask (observations) are skipped: the advantages of the model's tokens equal
    those of the same tokens laid out without the holes, and the final reward reaches turn one."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)  # prompt, turn, obs, turn, pad
    values, rewards = torch.randn(1, 10, generator=g), torch.zeros(1, 10)
    rewards[0, 7] = 1.0
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0] > 0
    dense_adv, dense_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, keep], dense_adv) and torch.allclose(ret[:, keep], dense_ret)
    assert (adv[:, ~keep] == 0).all() and adv[0, 1] != 0
