"""PPO per-token rewards: KL penalty on response tokens, score at the last one (hand-computed)."""
import pytest
import torch

from algorithms.ppo.rewards import kl_penalized_rewards, last_response_index, shape_scores

pytestmark = pytest.mark.unit

MASK = torch.tensor([[0., 1., 1., 1., 0.],
                     [0., 0., 1., 1., 1.]])


def test_kl_penalty_on_response_and_score_on_last_token():
    logp = torch.tensor([[-9.0, -1.0, -2.0, -0.5, -9.0],
                         [-9.0, -9.0, -1.0, -2.0, -3.0]])
    ref = torch.tensor([[-3.0, -1.5, -1.0, -0.5, -7.0],
                        [-1.0, -2.0, -1.2, -2.0, -2.5]])
    rewards = kl_penalized_rewards(logp, ref, MASK, torch.tensor([2.0, -1.0]), kl_coef=0.1)
    expected = torch.tensor([[0.0, -0.05, 0.10, 2.0, 0.0],
                             [0.0, 0.0, -0.02, 0.0, 0.05 - 1.0]])
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)


def test_zero_kl_coef_leaves_only_the_score():
    logp, ref = torch.randn(2, 5), torch.randn(2, 5)
    rewards = kl_penalized_rewards(logp, ref, MASK, torch.tensor([0.5, 3.0]), kl_coef=0.0)
    assert rewards.nonzero().tolist() == [[0, 3], [1, 4]]
    assert rewards[0, 3].item() == 0.5 and rewards[1, 4].item() == 3.0


def test_last_response_index_and_dropped_rows():
    assert last_response_index(MASK).tolist() == [3, 4]
    dropped = torch.tensor([[0., 1., 1.], [0., 0., 0.]])   # row 1 dropped (non-finite score): no reward
    assert last_response_index(dropped).tolist() == [2, -1]
    rewards = kl_penalized_rewards(torch.zeros(2, 3), torch.ones(2, 3), dropped, torch.tensor([1.0, 9.0]), 0.5)
    assert rewards.tolist() == [[0.0, 0.5, 1.5], [0.0, 0.0, 0.0]]


def test_shape_scores_scales_then_clips():
    shaped = shape_scores(torch.tensor([3.0, -5.0, 0.5]), scale=2.0, clip=4.0)
    assert shaped.tolist() == [4.0, -4.0, 1.0]
    assert shape_scores(torch.tensor([3.0, -5.0]), scale=0.5).tolist() == [1.5, -2.5]
    with pytest.raises(ValueError, match="reward.clip to null"):
        shape_scores(torch.tensor([1.0]), clip=0.0)
