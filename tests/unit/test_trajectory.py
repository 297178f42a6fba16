"""Multi-turn trajectories (`xray/data/trajectory.py`): the engine's and the observations' tokens kept
exactly, the loss mask on the model's tokens only, behaviour log-probs at the model's tokens, limits."""
import pytest
import torch

from xray.data import columns as C
from xray.data.trajectory import Trajectory, TrajectoryLimits, pack_trajectories

pytestmark = pytest.mark.unit


def two_turns() -> Trajectory:
    t = Trajectory(prompt_ids=[1, 5, 6])
    t.add_turn([10, 11, 12], [-0.1, -0.2, -0.3])
    t.rewards.append(0.0)
    t.add_observation([20, 21])
    t.add_turn([13, 14], [-0.4, -0.5])
    t.rewards.append(1.0)
    t.finish("done")
    return t


def test_tokens_are_appended_as_given_and_only_the_models_are_trained():
    t = two_turns()
    assert t.ids == [1, 5, 6, 10, 11, 12, 20, 21, 13, 14]
    assert t.mask == [1, 1, 1, 0, 0, 1, 1] and t.turns == [(0, 3), (5, 7)] and t.score == 1.0
    short = Trajectory(prompt_ids=[1, 2])
    short.add_turn([30], [-1.0])
    short.finish("error", "Env.step: RuntimeError: gone")
    batch = pack_trajectories([t, short], pad_id=0)
    assert batch[C.INPUT_IDS].tolist() == [t.ids, [1, 2, 30] + [0] * 7]
    # position k scores token k+1: the prompt's last token predicts the first model token
    assert batch[C.LOSS_MASK].tolist() == [[0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 1] + [0] * 7]
    expected = torch.tensor([[0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5], [0, -1.0] + [0] * 7])
    assert torch.equal(batch[C.BEHAVIOUR_LOGPROBS], expected)
    assert batch[C.SCORES].tolist() == [1.0, 0.0]
    assert (batch[C.LOSS_MASK] * (batch[C.INPUT_IDS][:, 1:] >= 20).float() * (batch[C.INPUT_IDS][:, 1:] <= 21).float()
            ).sum() == 0  # no observation token is trained


def test_limits_bound_the_next_turn():
    limits = TrajectoryLimits(max_turns=2, max_turn_tokens=4, max_tokens=9)
    t = Trajectory(prompt_ids=[1])
    assert t.room(limits) == 4
    t.add_turn([2, 3, 4, 5], [0.0] * 4)
    t.add_observation([6, 7, 8])
    assert t.room(limits) == 2  # 9 - 7 tokens left
    t.add_turn([9, 10], [0.0, 0.0])
    assert t.room(limits) == 0  # two turns taken
    with pytest.raises(ValueError, match="3 tokens came with 2 log-probs"):
        t.add_turn([1, 2, 3], [0.0, 0.0])
    with pytest.raises(ValueError, match="unknown end 'bored'"):
        t.finish("bored")
