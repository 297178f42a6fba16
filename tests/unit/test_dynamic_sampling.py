"""DAPO's dynamic sampling (`algorithms/critic_free/dynamic.py`): which groups vary, against
hand-computed values and veRL's filter (std > 0) on random scores, and how rounds are joined into
one batch of whole groups (varied first, then dropped ones to fill), with the config's checks."""
import pytest
import torch

from algorithms.critic_free.advantages import grpo_advantages, varied_groups
from algorithms.critic_free.dynamic import select
from xray.run.algorithm import Sampled
from xray.data import columns as C
from xray.data.batch import Batch
from algorithms.specs import default_config, command_spec

pytestmark = pytest.mark.unit


def test_varied_groups_by_hand_and_as_verls_filter():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0, 0.5])
    assert varied_groups(scores, 3).tolist() == [False, False, True, True]
    keep = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1])  # invalid samples do not count
    assert varied_groups(scores, 3, keep).tolist() == [False, False, True, False]
    assert varied_groups(scores, 1).all()
    g = torch.Generator().manual_seed(0)
    random = torch.randint(0, 2, (64,), generator=g).float()  # 0/1 rewards, groups of 4
    verl = random.reshape(16, 4).std(1) > 0
    assert varied_groups(random, 4).tolist() == verl.tolist()
    flat = ~varied_groups(random, 4)  # a group that does not vary has no GRPO advantage
    assert float(grpo_advantages(random, 4).reshape(16, 4)[flat].abs().max()) == 0.0


def _round(scores: list[float], width: int, tag: int) -> Sampled:
    n = len(scores)
    attn = torch.ones(n, width, dtype=torch.long)
    exp = Batch({C.INPUT_IDS: torch.full((n, width), tag), C.ATTENTION_MASK: attn})
    answer = Batch({C.LOGPROBS: torch.full((n, width - 1), -float(tag))})
    return Sampled(exp, torch.tensor(scores), None, {"actor": answer})


def test_rounds_join_into_whole_groups_varied_first_then_filled():
    first = _round([1, 1, 0, 1, 0, 0], width=5, tag=1)  # groups of 2: flat, varied, flat
    second = _round([1, 0, 1, 1], width=7, tag=2)  # varied, flat
    got, metrics = select([first, second], n=2, groups=3)
    assert got.scores.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # varied: r1 g1, r2 g0; then r1 g0 fills
    assert got.exp[C.INPUT_IDS][:, 0].tolist() == [1, 1, 2, 2, 1, 1]
    assert got.exp[C.INPUT_IDS].shape == (6, 7) and got.exp[C.ATTENTION_MASK][0].tolist() == [1] * 5 + [0] * 2
    assert got.answers["actor"][C.LOGPROBS][:, 0].tolist() == [-1.0, -1.0, -2.0, -2.0, -1.0, -1.0]
    assert got.keep is None
    assert metrics == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/varied_groups": 2.0,
                       "dynamic_sampling/sampled_groups": 5.0, "dynamic_sampling/filled_groups": 1.0}
    full, metrics = select([first, second], n=2, groups=2)
    assert full.scores.tolist() == [0.0, 1.0, 1.0, 0.0] and metrics["dynamic_sampling/filled_groups"] == 0.0


def test_the_config_refuses_dynamic_sampling_it_cannot_do():
    from xray.config import ConfigError, load_config
    from xray.config.plan import plan_run

    plan_run(load_config(default_config("grpo"), [("critic_free.dynamic_sampling", True)]), "megatron-vllm", command_spec("grpo"))
    bad = load_config(default_config("grpo"), [("critic_free.dynamic_sampling", True),
                                                ("critic_free.max_sample_rounds", 0)])
    with pytest.raises(ConfigError, match="critic_free.dynamic_sampling"):
        plan_run(bad, "megatron-vllm", command_spec("grpo"))
