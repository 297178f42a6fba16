"""Several reward functions with weights (`reward.functions` / `reward.weights`, TRL's rule: None
is NaN, a weighted nansum across functions, a sample no function scored left to
`reward.on_nonfinite`), their `reward/<name>` metrics, the config section's checks, and
`reward.workers` (the functions called in worker processes on chunks of the batch)."""
import cloudpickle
import pytest
import torch

from xray.config.reward import RewardConfig
from xray.config.typed import ConfigError, build
from xray.data.tokenizer import build_char_tokenizer
from xray.rewards.compose import combine, function_names, means
from xray.rewards.loader import RewardFunctionError, RewardScorer, RewardSpecError

pytestmark = pytest.mark.unit

TOK = build_char_tokenizer()
TEXTS = ["12", "345", "6", "7890", "1"]
ROWS = [{"prompt": f"{i}+{i}=", "prompt_ids": TOK(f"{i}+{i}=").input_ids, "level": i} for i in range(5)]
RESPONSES = [TOK(t).input_ids + [TOK.eos_token_id] for t in TEXTS]


def correct(prompts, completions, level, **_):
    return [{0: 1.0, 1: None, 2: 0.5, 3: None, 4: 1.0}[lv] for lv in level]


def length(prompts, completions, level, **_):
    return [{0: 0.0, 1: 2.0, 2: None, 3: None, 4: 4.0}[lv] for lv in level]


def test_weights_and_none_follow_trl():
    per_function = [correct(None, TEXTS, level=range(5)), length(None, TEXTS, level=range(5))]
    nan = float("nan")
    table = torch.tensor([[nan if v is None else v for v in col] for col in per_function]).T  # [B, F]
    trl = (table * torch.tensor([2.0, 0.5])).nansum(dim=1)  # TRL's GRPOTrainer rule
    assert trl.tolist() == [2.0, 1.0, 1.0, 0.0, 4.0]
    got = combine([[nan if v is None else v for v in col] for col in per_function], [2.0, 0.5])
    assert got[:3] + got[4:] == [2.0, 1.0, 1.0, 4.0] and got[3] != got[3]  # row 3: no function scored it
    scorer = RewardScorer([correct, length], TOK, on_nonfinite="skip", weights=[2.0, 0.5])
    scores, keep = scorer(ROWS, RESPONSES)
    assert scores.tolist() == [2.0, 1.0, 1.0, 0.0, 4.0] and keep.tolist() == [True, True, True, False, True]
    assert scorer.take_metrics() == {"reward/correct": 2.5 / 3, "reward/length": 2.0}  # unweighted means
    assert scorer.take_metrics() == {}  # taken
    with pytest.raises(RewardFunctionError, match=r"every one of the reward functions \(correct, length\) returned "
                                                  r"nan for row 3.*on_nonfinite=skip"):
        RewardScorer([correct, length], TOK, weights=[2.0, 0.5])(ROWS, RESPONSES)


def test_one_function_is_a_list_of_one():
    scorer = RewardScorer(correct, TOK, on_nonfinite="skip", weights=[3.0])
    scores, keep = scorer(ROWS, RESPONSES)
    assert scores.tolist() == [3.0, 0.0, 1.5, 0.0, 3.0] and keep.tolist() == [True, False, True, False, True]
    def short(prompts, completions, **_):
        return [1.0, 2.0]

    with pytest.raises(RewardFunctionError, match="the reward function 'short' returned 2 scores for 5"):
        RewardScorer([correct, short], TOK)(ROWS, RESPONSES)


def test_metric_names_are_unique():
    def mean(**_): ...
    assert function_names([correct, length, mean, correct]) == ["correct_1", "length", "mean_3", "correct_4"]
    assert means([{"a": (3.0, 2), "b": (0.0, 0)}, {"a": (1.0, 2)}]) == {"reward/a": 1.0}


def test_config_section():
    both = RewardConfig(function=None, functions=["m:a", "m:b"], weights=[1, 0.5], workers=2)
    assert both.specs == ("m:a", "m:b") and RewardConfig().specs == ("xray.rewards.builtin:exact_answer",)
    assert RewardConfig(function=None).specs == ()
    with pytest.raises(ConfigError, match="both function .* and functions are set; set reward.function=null"):
        build(RewardConfig, {"functions": ["m:a"]}, "reward")
    with pytest.raises(ConfigError, match="reward.weights has 1 weights for 2 reward functions"):
        RewardConfig(function=None, functions=["m:a", "m:b"], weights=[1.0])
    with pytest.raises(ConfigError, match="names a function twice"):
        RewardConfig(function=None, functions=["m:a", "m:a"])
    with pytest.raises(ConfigError, match="reward.workers=-1"):
        RewardConfig(workers=-1)
    scorer = RewardScorer.from_config(RewardConfig(function=None, functions=[
        "xray.rewards.builtin:exact_answer", "xray.rewards.math_answer:math_answer"], weights=[1, 2]), TOK)
    assert scorer.names == ["exact_answer", "math_answer"] and scorer.weights == [1.0, 2.0]
    assert RewardScorer.from_config(RewardConfig(function=None, model="/rm"), TOK) is None


CPU_REWARDS = '''
def correct(prompts, completions, level, **_):
    return [{0: 1.0, 1: None, 2: 0.5, 3: None, 4: 1.0}[lv] for lv in level]

def busy(prompts, completions, completion_ids, level, **_):
    return [len(c) * 10 + ids[-1] % 7 + lv / 4 for c, ids, lv in zip(completions, completion_ids, level)]

def picky(prompts, completions, level, **_):
    if 3 in level:
        raise ValueError("level 3 is not allowed")
    return [1.0] * len(completions)
'''


def test_workers_give_the_thread_scores(tmp_path):
    f = tmp_path / "cpu_rewards.py"
    f.write_text(CPU_REWARDS)
    thread = RewardScorer([f"{f}:busy", correct], TOK, on_nonfinite="skip")
    pooled = RewardScorer([f"{f}:busy", f"{f}:correct"], TOK, on_nonfinite="skip", workers=2)
    assert pooled.by_name == [f"{f}:busy", f"{f}:correct"]
    expected = [20 + 2 % 7 + 0.0 + 1.0, 30 + 2 % 7 + 0.25, 10 + 2 % 7 + 0.5 + 0.5, 40 + 2 % 7 + 0.75, 10 + 2 % 7 + 1.0 + 1.0]
    for scorer in (thread, pooled):
        scores, keep = scorer(ROWS, RESPONSES)
        assert scores.tolist() == pytest.approx(expected) and keep.all()
    assert pooled.take_metrics() == thread.take_metrics()
    with pytest.raises(RewardFunctionError, match="on row 3 of the batch") as info:  # row 3 sits in the 2nd chunk
        RewardScorer(f"{f}:picky", TOK, workers=2)(ROWS, RESPONSES)
    assert info.value.row == 3 and "level 3 is not allowed" in info.value.traceback_text
    back = cloudpickle.loads(cloudpickle.dumps(pooled))  # as Ray sends it to a maker: the pool is left behind,
    assert back.pool._executor is None and back.pool.workers == 2  # started there on first use
    pooled.pool.close()
    assert RewardScorer(correct, TOK, workers=1).by_name == ["tests.unit.test_reward_compose:correct"]
    with pytest.raises(RewardSpecError, match="has no importable name: define it at the top level"):
        RewardScorer(lambda prompts, completions, **_: [0.0] * len(prompts), TOK, workers=1)
