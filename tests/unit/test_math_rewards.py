"""The built-in math rewards (`xray.rewards.math_answer`): the final answer of a reasoning
completion (last `\\boxed{}`, else `#### N`, else the last number) against GSM8K's `#### N`
rationale or MATH's `\\boxed{}` solution, numeric equivalence, and `math_verify` (math-verify in
worker processes, a deadline per sample kept by the parent) called as the run calls it: from a
worker thread, through `RewardScorer`, on a real tokenizer's decoded responses."""
import asyncio
import threading
import time

import pytest

from xray.rewards import symbolic
from xray.rewards.builtin import exact_answer
from xray.rewards.loader import RewardFunctionError, RewardScorer
from xray.rewards.math_answer import (boxed_contents, final_answer, gold_answer, math_answer, math_verify_reward,
                                      same_answer, to_number)

pytestmark = pytest.mark.unit

NATALIA = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?")
RATIONALE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72"


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def scored(scorer: RewardScorer, tok, rows: list[dict], texts: list[str]) -> list[float]:
    """Scores of `texts` as the run gets them: token ids ending in EOS, decoded by the scorer, the
    synchronous function called in a worker thread (`acall` -> `asyncio.to_thread`)."""
    responses = [tok(t).input_ids + [tok.eos_token_id] for t in texts]
    scores, keep = asyncio.run(scorer.acall(rows, responses))
    assert keep.all()
    return scores.tolist()


def chat_row(tok, question: str, gold: str, column: str = "answer") -> dict:
    prompt = [{"role": "user", "content": question}]
    return {"prompt": prompt, "prompt_ids": tok.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"],
            column: gold}


def test_gsm8k_row_scores_the_final_answer_not_an_intermediate_one(tok):
    row = chat_row(tok, NATALIA, RATIONALE)
    right_last = "At first I guessed 96, but half of 48 is 24, so she sold 48 + 24 = 72 clips."
    wrong_last = "She sold 48 + 24 = 72 clips? No: she sold 96 clips."
    texts = [right_last, wrong_last, "She sold 48 + 24 clips in all, that is \\boxed{72}; 2 months.",
             "Half of 48 is 24.\n#### 72", "I do not know."]
    scorer = RewardScorer("xray.rewards.math_answer:math_answer", tok)
    assert scored(scorer, tok, [row] * len(texts), texts) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert scorer.take_metrics() == {"reward/math_answer": pytest.approx(3 / 5)}
    # the built-in task's reward reads the first integer: wrong for reasoning, as documented
    assert exact_answer(None, [right_last, wrong_last], answer=["72", "72"]) == [0.0, 0.0]


def test_gsm8k_commas_dollars_and_decimals_are_numbers(tok):
    row = chat_row(tok, "How much did the house cost?", "It cost 4 * 250 = <<4*250=1000>>1,000 dollars.\n#### 1,000")
    texts = ["The house cost $1,000.", "So 1000.00 dollars in all.", "It cost 4 * 250 = 1000, i.e. 100 each day."]
    assert scored(RewardScorer("xray.rewards.math_answer:math_answer", tok), tok, [row] * 3, texts) == [1.0, 1.0, 0.0]


def test_boxed_answers_keep_nested_braces():
    text = r"First \boxed{2}, then \boxed{\frac{1}{\sqrt{2}}} and \boxed{\{1, 2\}} and an open \boxed{3"
    assert boxed_contents(text) == ["2", r"\frac{1}{\sqrt{2}}", r"\{1, 2\}"]
    assert final_answer(r"so $x = \boxed{\dfrac{\pi}{2}}$ (about 1.57)") == r"\dfrac{\pi}{2}"
    assert final_answer(r"\boxed{} and then 7") is None  # an empty box answers nothing
    assert final_answer("24 clips, then 72\n#### 72 clips\nthat is all, 3 lines") == "72 clips"
    assert final_answer("-2.5 or 3/4") == "3/4" and final_answer("no number here") is None
    # gold answers: GSM8K's rationale, MATH's worked solution, a bare answer
    assert gold_answer(RATIONALE) == "72"
    assert gold_answer(r"We get $\boxed{2}$ first, so the answer is $\boxed{\frac{\sqrt{3}}{2}}$.") == r"\frac{\sqrt{3}}{2}"
    assert gold_answer(r" \frac{1}{2} ") == r"\frac{1}{2}" and gold_answer("  ") is None and gold_answer(None) is None


def test_numeric_equivalence():
    assert [to_number(s) for s in ["72", "72.0", "$72", r"\$1,000", "72%", "-3/4", r"\frac{1}{2}", "+1e3", "5."]] == \
        [72, 72, 72, 1000, 72, -0.75, 0.5, 1000, 5]
    assert to_number("x+1") is None and to_number("1,2") is None and to_number("3/0") is None
    assert same_answer("72", "72.0") and same_answer("72", "$72") and same_answer("0.5", "1/2")
    assert not same_answer("72", "720") and not same_answer("72", "7.2")
    assert same_answer("x + 1", "x+1") and not same_answer("x+1", "1+x")  # texts: spaces only


def test_gold_columns_answer_then_solution():
    completions = [[{"role": "assistant", "content": r"so \boxed{\frac{3}{6}}"}], [{"role": "assistant", "content": "7"}]]
    assert math_answer(None, completions, solution=[r"It is $\boxed{0.5}$.", r"$\boxed{8}$"]) == [1.0, 0.0]
    assert math_answer(None, completions, answer=["1/2", ""], solution=["9", "7"]) == [1.0, 1.0]  # per row
    assert math_answer(None, completions, answer=["1/2", None]) == [1.0, None]  # no gold: no score
    with pytest.raises(KeyError, match="`answer` column .* or its `solution` column"):
        math_answer(None, completions, question=["q", "q"])


def test_math_verify_in_the_scorer_from_a_worker_thread(tok):
    rows = [chat_row(tok, "What is one half?", r"The answer is $\boxed{\frac{1}{2}}$.", column="solution"),
            chat_row(tok, "What is sin 45 degrees?", r"\sqrt{2}/2"),
            chat_row(tok, "Simplify x + 1.", "1 + x"),
            chat_row(tok, "What is sin 60 degrees?", r"\frac{\sqrt{3}}{2}")]
    for r in rows[1:]:
        r["solution"] = None  # a MATH-style column beside: `answer` wins where it is set
    rows[0]["answer"] = None
    texts = [r"One half is 0.5, so \boxed{0.5}.", r"It is \boxed{\frac{\sqrt{2}}{2}}.", r"\boxed{x+1}",
             r"\boxed{\sqrt{2}/2}"]
    scorer = RewardScorer("xray.rewards.math_answer:math_verify", tok, workers=2)
    assert scorer.by_name == [None]  # it runs in its own processes, never in reward.workers'
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(scores=scored(scorer, tok, rows, texts)))
    thread.start()
    thread.join(120)
    assert out["scores"] == [1.0, 1.0, 1.0, 0.0]
    assert scorer.pool is None or scorer.pool._executor is None  # reward.workers' pool was never started


def test_math_verify_past_its_deadline_scores_zero_and_the_pool_goes_on():
    pool = symbolic.pool(symbolic.WORKERS)
    replaced = pool.replaced
    reward = math_verify_reward(timeout_s=1.0, workers=symbolic.WORKERS)
    t0 = time.perf_counter()
    out = reward(None, [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{\sqrt{2}}{2}}", r"\boxed{x + 1}"],
                 answer=["1", r"\sqrt{2}/2", "1+x"])  # 9^9^9^9: an integer power no signal can stop
    assert out == [0.0, 1.0, 1.0] and time.perf_counter() - t0 < 60
    assert pool.replaced == replaced + 1  # the hung worker was killed and replaced
    assert reward(None, [r"\boxed{\frac{\sqrt{2}}{2}}", r"\boxed{\sqrt{3}}"], answer=[r"\sqrt{2}/2", r"\sqrt{2}/2"]) \
        == [1.0, 0.0]


def test_math_verify_in_a_thread_says_to_use_workers(tmp_path, tok):
    f = tmp_path / "mv_reward.py"
    f.write_text("from math_verify import parse, verify\n"
                 "def mv(completions, answer, **_):\n"
                 "    return [float(verify(parse(a), parse(c[-1]['content']))) for c, a in zip(completions, answer)]\n")
    rows = [chat_row(tok, "Half?", "$0.5$")]
    with pytest.raises(RewardFunctionError, match="set reward.workers=1 or more"):
        scored(RewardScorer(f"{f}:mv", tok), tok, rows, [r"$\frac{1}{2}$"])
    assert scored(RewardScorer(f"{f}:mv", tok, workers=1), tok, rows, [r"$\frac{1}{2}$"]) == [1.0]


def boxed_format(completions, **_):
    return [float("\\boxed{" in c[-1]["content"]) for c in completions]


def test_trl_accuracy_reward_none_for_an_unparsable_gold_does_not_stop_a_combined_run(tok):
    rows = [chat_row(tok, "Half?", r"$\frac{1}{2}$", column="solution"),
            chat_row(tok, "Say hi.", "no math here at all", column="solution")]
    texts = [r"\boxed{\frac{1}{2}}", r"\boxed{3}"]
    combined = RewardScorer(["trl.rewards:accuracy_reward", boxed_format], tok, weights=[1.0, 0.5])
    assert scored(combined, tok, rows, texts) == [1.5, 0.5]  # accuracy's None counts as nothing
    assert combined.take_metrics() == {"reward/accuracy_reward": 1.0, "reward/boxed_format": 1.0}
    alone = RewardScorer("trl.rewards:accuracy_reward", tok)  # no function scored row 1: on_nonfinite decides
    with pytest.raises(RewardFunctionError, match="returned nan for row 1 .*set reward.on_nonfinite=skip"):
        scored(alone, tok, rows, texts)
    responses = [tok(t).input_ids + [tok.eos_token_id] for t in texts]
    scores, keep = asyncio.run(RewardScorer("trl.rewards:accuracy_reward", tok, on_nonfinite="skip").acall(rows, responses))
    assert scores.tolist() == [1.0, 0.0] and keep.tolist() == [True, False]
