"""PPO per-token rewards: KL penalty on response tokens, score at the last one (hand-computed)."""
import pytest
import torch

from algorithms.core.rewards import kl_penalized_rewards, last_response_index, shape_scores
from algorithms.specs import default_config, command_spec

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


def test_overlong_penalty_is_dapos_soft_punishment_and_the_config_checks_it():
    from algorithms.core.rewards import overlong_penalty, run_scores
    from xray.config import ConfigError, load_config
    from xray.config.plan import plan_run

    lengths = torch.tensor([3, 12, 13, 14, 16, 20])
    got = overlong_penalty(lengths, limit=16, buffer=4, penalty=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]  # 0 up to 12, then down to -0.5 at 16
    assert overlong_penalty(lengths, 16, 0, 0.5).tolist() == [0.0] * 6
    g = torch.Generator().manual_seed(0)
    random_lengths = torch.randint(0, 65, (100,), generator=g)  # veRL's: min(-(L - (limit - buffer)) / buffer * f, 0)
    verl = torch.clamp(-(random_lengths.float() - (64 - 16)) / 16 * 1.5, max=0.0)
    torch.testing.assert_close(overlong_penalty(random_lengths, 64, 16, 1.5), verl)
    cfg = load_config(default_config("grpo"), [("rollout.max_new_tokens", 16), ("reward.overlong_buffer", 4),
                                                ("reward.scale", 2.0)])
    mask = (torch.arange(16)[None, :] < torch.tensor([[12], [16]])).float()
    assert run_scores(torch.tensor([1.0, 1.0]), mask, cfg).tolist() == [2.0, 1.0]  # scaled, then punished
    plan_run(cfg, "megatron-vllm", command_spec("grpo"))
    for bad in ([("reward.overlong_buffer", 16)], [("reward.overlong_buffer", 4), ("reward.overlong_penalty", -1.0)]):
        with pytest.raises(ConfigError, match="reward.overlong_buffer"):
            plan_run(load_config(default_config("grpo"), [("rollout.max_new_tokens", 16), *bad]), "megatron-vllm", command_spec("grpo"))
