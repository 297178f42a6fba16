"""The built-in calculator task (`xray/env/tasks.py`): seeded prompts in the character vocabulary
with exact answers, the `builtin:calculator` environment played to the end, the reward, and the
tool-use demonstrations laid out as a trajectory is (loss mask on the model's turns only)."""
import asyncio

import pytest

from xray.data.tokenizer import CHARS, EOS_ID, build_char_tokenizer
from xray.env.base import load_env
from xray.env.tasks import (COMPACT, CalculatorEnv, CalculatorTask, CalculatorTaskError, calculator_reward,
                            demonstration, demonstration_ids)

pytestmark = pytest.mark.unit


def test_rows_are_seeded_in_the_character_vocabulary_and_exact():
    task = CalculatorTask()
    rows = task.rows(200, seed=5)
    assert rows == task.rows(200, seed=5) and rows != task.rows(200, seed=6)
    for row in rows:
        a, op, b = row["expression"][:4], row["expression"][4], row["expression"][5:]
        assert len(a) == 4 and len(b) == 2 and a[0] != "0" and b[0] != "0" and op in "+-*"
        assert row["prompt"] == f"q: {row['expression']}=?"
        assert row["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
        assert set("".join(s for s, _ in demonstration(row))) <= set(CHARS)
    assert {r["expression"][4] for r in rows} == {"+", "-", "*"}
    assert {r["expression"][1] for r in CalculatorTask(a_digits=2, ops=("*",)).rows(50)} <= set("0123456789")
    with pytest.raises(CalculatorTaskError, match="choose one or more of"):
        CalculatorTask(ops=("/",))
    with pytest.raises(CalculatorTaskError, match="must be >= 1"):
        CalculatorTask(b_digits=0)


def test_the_reward_wants_the_exact_answer_as_a_whole_number():
    row = {"answer": "178377"}
    assert calculator_reward(row, "178377") == 1.0 and calculator_reward(row, "it is 178377.") == 1.0
    assert calculator_reward(row, "1783771") == 0.0 and calculator_reward(row, "17837") == 0.0
    assert calculator_reward({"answer": "42"}, "-42") == 0.0 and calculator_reward({"answer": "-42"}, "-42") == 1.0


def test_the_environment_answers_a_compact_call_then_scores_the_final_turn():
    assert load_env("builtin:calculator") is CalculatorEnv
    row = CalculatorTask(ops=("*",)).rows(1, seed=1)[0]

    async def episode(final):
        env = CalculatorEnv()
        first = await env.reset(row)
        call = await env.step(f"<tool_call>calculator: {row['expression']}</tool_call>")
        return first, call, await env.step(final)
    first, call, end = asyncio.run(episode(row["answer"]))
    assert first == row["prompt"]
    assert call == (f"<tool_response>{row['answer']}</tool_response>", 0.0, False, {"tool_calls": 1})
    assert end == ("", 1.0, True, {"tool_calls": 1})
    assert asyncio.run(episode("12"))[2][1] == 0.0


def test_demonstrations_mask_the_prompt_and_the_tool_answer():
    tokenizer = build_char_tokenizer()
    row = {"prompt": "q: 4821*37=?", "answer": "178377", "expression": "4821*37"}
    assert demonstration(row) == [("q: 4821*37=?", False), ("<tool_call>calculator: 4821*37</tool_call>", True),
                                  ("<tool_response>178377</tool_response>", False), ("178377", True)]
    ids, mask = demonstration_ids(row, tokenizer)
    assert len(ids) == len(mask) == 1 + 12 + 42 + 1 + 37 + 6 + 1 <= 128  # fits the built-in model
    assert ids[0] == tokenizer.bos_token_id and ids.count(EOS_ID) == 2
    model = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(model) == "<tool_call>calculator: 4821*37</tool_call></s>178377</s>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=True) == (
        "q: 4821*37=?" + COMPACT.response("178377"))
