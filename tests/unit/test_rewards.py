"""Reward functions: `module:function` resolution, TRL calling convention, errors that carry the
offending prompt and traceback, NaN/inf handling, and the built-in verifiable rewards."""
import math
import pickle

import pytest

from xray.rewards.builtin import exact_answer, strict_answer
from xray.data.prompts import PromptSet
from xray.data.tokenizer import build_char_tokenizer
from xray.rewards.loader import (RewardFunctionError, RewardScorer, RewardSpecError, call_reward_function,
                                 check_scores, compute_scores, load_reward_function)

pytestmark = pytest.mark.unit

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]
EXTRAS = {"answer": ["2", "4", "6"], "level": [1, 2, 3]}


def test_resolves_module_function_and_file(tmp_path):
    assert load_reward_function("xray.rewards.builtin:exact_answer") is exact_answer
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_function(f"{f}:length")
    assert fn(prompts=["a"], completions=["abc"]) == [3.0]
    # a dataclass under postponed annotations looks its module up in sys.modules while it is defined
    g = tmp_path / "graded.py"
    g.write_text("from __future__ import annotations\nfrom dataclasses import dataclass\n\n@dataclass\nclass Grade:\n"
                 "    weight: float = 0.5\n\ndef score(prompts, completions, **kw):\n"
                 "    return [Grade().weight * len(c) for c in completions]\n")
    assert load_reward_function(f"{g}:score")(prompts=["a"], completions=["ab"]) == [1.0]


@pytest.mark.parametrize("spec, message", [
    ("no_colon_here", "not of the form module:function"),
    ("xray_no_such_module_zz:f", "cannot import module 'xray_no_such_module_zz'"),
    ("xray.rewards.builtin:nope", r"has no attribute 'nope'.*exact_answer"),
    ("xray.rewards.builtin:_NUMBER", "is a Pattern, not a function"),
    ("/no/such/file.py:f", "no file"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(RewardSpecError, match=message):
        load_reward_function(spec)


def test_trl_convention_passes_extras_and_completion_ids():
    seen = {}

    def fn(prompts, completions, **kwargs):
        seen.update(kwargs, prompts=prompts, completions=completions)
        return [0.5] * len(prompts)

    assert call_reward_function(fn, PROMPTS, COMPLETIONS, EXTRAS, completion_ids=[[5], [8], [9]]) == [0.5] * 3
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "answer": ["2", "4", "6"],
                    "level": [1, 2, 3], "completion_ids": [[5], [8], [9]]}

    def narrow(completions, answer):  # no **kwargs: gets only what it names
        return [float(c == a) for c, a in zip(completions, answer)]

    assert compute_scores(narrow, PROMPTS, COMPLETIONS, EXTRAS).scores.tolist() == [1.0, 0.0, 1.0]


def test_chat_prompts_get_message_completions():
    got = []
    chat = [[{"role": "user", "content": "hi"}]]
    call_reward_function(lambda prompts, completions, **_: got.extend(completions) or [1.0], chat, ["yo"], {})
    assert got == [[{"role": "assistant", "content": "yo"}]]


def picky(prompts, completions, answer, **_):
    return [1.0 / (int(c) - 5) for c in completions]   # ZeroDivisionError on "5"


def test_raising_function_names_first_failing_row_with_traceback():
    with pytest.raises(RewardFunctionError) as info:
        compute_scores(picky, PROMPTS, COMPLETIONS, EXTRAS)
    err = info.value
    assert (err.row, err.prompt, err.completion) == (1, "2+2=", "5")
    assert "ZeroDivisionError" in err.traceback_text and "picky" in err.traceback_text
    assert "prompt '2+2='" in str(err) and "resume from the last checkpoint" in str(err)
    assert isinstance(err.__cause__, ZeroDivisionError)
    back = pickle.loads(pickle.dumps(err))
    assert (back.row, back.prompt, back.traceback_text) == (1, "2+2=", err.traceback_text)


def test_batch_only_failure_reports_first_prompt():
    def batch_only(prompts, completions, **_):
        if len(prompts) > 1:
            raise RuntimeError("needs one at a time")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="needs one at a time") as info:
        compute_scores(batch_only, PROMPTS, COMPLETIONS, EXTRAS)
    assert info.value.row == 0 and info.value.prompt == "1+1="


def test_nonfinite_scores_error_or_skip():
    with pytest.raises(RewardFunctionError, match=r"returned nan for row 1 \(prompt '2\+2='.*on_nonfinite=skip"):
        check_scores([1.0, math.nan, 0.5], PROMPTS, COMPLETIONS)
    with pytest.raises(RewardFunctionError, match="returned inf for row 2"):
        check_scores([1.0, 0.0, math.inf], PROMPTS, COMPLETIONS)
    kept = check_scores([1.0, None, 0.5], PROMPTS, COMPLETIONS, on_nonfinite="skip")
    assert kept.scores.tolist() == [1.0, 0.0, 0.5] and kept.keep.tolist() == [True, False, True]
    with pytest.raises(RewardFunctionError, match="every one of the 3 scores"):
        check_scores([math.nan, -math.inf, None], PROMPTS, COMPLETIONS, on_nonfinite="skip")


def test_malformed_answers_are_errors():
    with pytest.raises(RewardFunctionError, match="returned 2 scores for 3 completions"):
        check_scores([1.0, 0.0], PROMPTS, COMPLETIONS)
    with pytest.raises(RewardFunctionError, match="returned a str for row 0"):
        check_scores(["1.0", 0.0, 0.0], PROMPTS, COMPLETIONS)
    assert check_scores([True, 0, 2], PROMPTS, COMPLETIONS).scores.tolist() == [1.0, 0.0, 2.0]


def test_builtin_rewards():
    completions = ["42", " 42 ", "42+1", "4 2", "", "-3"]
    answers = ["42", "42", "42", "42", "42", -3]
    assert exact_answer(completions, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert strict_answer(completions, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_scorer_decodes_responses_and_reads_prompt_rows():
    tok = build_char_tokenizer()
    ps = PromptSet(["1+1=", "2+2=", "3+3="], [tok(p).input_ids for p in ["1+1=", "2+2=", "3+3="]],
                   {"answer": ["2", "4", "6"]})
    rows = ps.rows([0, 1, 2, 2])
    assert rows[1] == {"answer": "4", "prompt": "2+2=", "prompt_ids": [1, 6, 41, 6, 45]}
    responses = [[6, 2], [8, 2], [10, 2], [10, 10, 2]]        # "2", "4", "6", "66" (EOS=2 is dropped)
    scores, keep = RewardScorer("xray.rewards.builtin:exact_answer", tok)(rows, responses)
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0] and keep.all()
    nan_on_66 = lambda prompts, completions, **_: [float("nan") if c == "66" else 1.0 for c in completions]  # noqa
    scores, keep = RewardScorer(nan_on_66, tok, on_nonfinite="skip")(rows, responses)
    assert keep.tolist() == [True, True, True, False] and scores.tolist() == [1.0, 1.0, 1.0, 0.0]
