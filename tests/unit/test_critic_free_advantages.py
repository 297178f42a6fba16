"""GRPO, Dr. GRPO, RLOO and REINFORCE++ advantages against hand-computed values."""
import math

import pytest
import torch

from algorithms.critic_free.advantages import (grpo_advantages, per_token, reinforce_pp_advantages,
                                               returns_to_go, rloo_advantages)

pytestmark = pytest.mark.unit

# two prompts, three responses each
SCORES = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])


def test_grpo_centres_and_scales_each_group():
    adv = grpo_advantages(SCORES, 3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased, group 0: mean 1/3
    expected = [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_dr_grpo_does_not_scale_by_std():
    torch.testing.assert_close(grpo_advantages(SCORES, 3, scale_by_std=False),
                               torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))


def test_grpo_leaves_dropped_samples_out_of_their_group():
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # group 0: {1, 0}, mean 0.5, std sqrt(0.5)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 99.0, 2.0, 2.0, 2.0]), 3, valid=valid)
    s = math.sqrt(0.5) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0, 0.0, 0.0]), rtol=1e-6, atol=1e-6)


def test_rloo_baseline_is_the_mean_of_the_others():
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0]), 3)
    # 1 - 0, 0 - 0.5, 0 - 0.5 ; 3 - 1.5, 1 - 2.5, 2 - 2
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 1.5, -1.5, 0.0]))
    dropped = rloo_advantages(torch.tensor([1.0, 0.0, 7.0, 3.0, 1.0, 2.0]), 3,
                              valid=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]))
    assert dropped[:3].tolist() == [0.0, 0.0, 0.0]  # the one valid sample has no peer
    with pytest.raises(ValueError, match="n_samples >= 2"):
        rloo_advantages(SCORES, 1)
    with pytest.raises(ValueError, match="groups of 4"):
        rloo_advantages(SCORES, 4)


def test_per_token_broadcasts_over_the_response():
    mask = torch.tensor([[0., 1., 1., 0.], [0., 0., 1., 1.]])
    torch.testing.assert_close(per_token(torch.tensor([2.0, -1.0]), mask),
                               torch.tensor([[0., 2., 2., 0.], [0., 0., -1., -1.]]))


def test_reinforce_pp_returns_to_go_then_global_whitening():
    rewards = torch.tensor([[0.0, -0.1, -0.2, 1.0, 9.0], [0.0, 0.0, 0.3, -0.4, 0.0]])
    mask = torch.tensor([[0., 1., 1., 1., 0.], [0., 0., 1., 1., 0.]])
    g = returns_to_go(rewards, mask, gamma=1.0)
    torch.testing.assert_close(g, torch.tensor([[0., 0.7, 0.8, 1.0, 0.], [0., 0., -0.1, -0.4, 0.]]))
    half = returns_to_go(rewards, mask, gamma=0.5)
    torch.testing.assert_close(half[0, 1:4], torch.tensor([-0.1 + 0.5 * 0.3, 0.3, 1.0]))
    adv = reinforce_pp_advantages(rewards, mask)
    values = torch.tensor([0.7, 0.8, 1.0, -0.1, -0.4])
    var, mean = torch.var_mean(values)
    torch.testing.assert_close(adv[mask.bool()], (values - mean) / torch.sqrt(var + 1e-8), rtol=1e-5, atol=1e-6)
    assert adv[~mask.bool()].abs().max() == 0


def test_returns_to_go_skip_a_multi_turn_episodes_observations():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[9.0, 0.5, 0.0, 9.0, 9.0, 0.0, 1.0, 9.0]])  # off-mask rewards are ignored
    g = returns_to_go(rewards, mask, gamma=0.5)
    assert g.tolist() == [[0.0, 0.5 + 0.5 * (0.5 * 0.5), 0.5 * 0.5, 0.0, 0.0, 0.5, 1.0, 0.0]]
