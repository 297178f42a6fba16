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


def test_the_data_task_writes_its_splits_and_mixes_tool_use_with_direct_answers(tmp_path):
    """`data.path: builtin:calculator`: disjoint seeded splits with the columns the environment
    reads; the warm start's demonstrations are about half whole tool-use episodes (the tool's
    answer out of the loss) and half the answer at once."""
    import json

    from xray.builtin.tasks import get_task
    from xray.data.tokenizer import build_char_tokenizer

    task = get_task("builtin:calculator")
    files = task.write(tmp_path, eval_size=100)
    train = [json.loads(line) for line in files.train.read_text().splitlines()]
    held = [json.loads(line) for line in files.eval.read_text().splitlines()]
    assert len(held) == 100 and len(train) == task.count - 100
    assert held + train == task.rows()  # seeded: the same rows every time, the first held out
    assert set(train[0]) == {"prompt", "answer", "expression"}
    tok = build_char_tokenizer()
    rows = train[:200]
    demos = task.demonstrations([r["prompt"] for r in rows], {k: [r[k] for r in rows] for k in ("answer", "expression")},
                                tok)
    tool = [d for d in demos if tok.decode(d[1]).startswith("<tool_call>")]
    assert 70 <= len(tool) <= 130, len(tool)
    for (prompt, rest, mask), row in zip(demos, rows):
        assert tok.decode(prompt, skip_special_tokens=True) == row["prompt"] and len(rest) == len(mask)
        text = tok.decode(rest, skip_special_tokens=True)
        if text.startswith("<tool_call>"):
            response = tok(f"<tool_response>{row['answer']}</tool_response>", add_special_tokens=False).input_ids
            start = next(i for i in range(len(rest)) if rest[i:i + len(response)] == response)
            assert set(mask[start:start + len(response)]) == {0} and mask[-1] == 1
        else:
            assert text == row["answer"] and set(mask) == {1} and rest[-1] == tok.eos_token_id


def test_a_warm_start_batch_trains_the_demonstrations_model_turns_only():
    from algorithms.sft import sft_rows
    from xray.data import columns as C

    pairs = [([1, 5], [6, 7, 8, 9], [1, 0, 0, 1]), ([1, 4, 4], [2, 3], [1, 1])]
    batch = sft_rows(pairs, batch_size=8, step=1, seed=0, pad_id=0)
    for row in range(8):
        prompt, rest, mask = next(p for p in pairs if batch[C.INPUT_IDS][row, :len(p[0]) + len(p[1])].tolist() == p[0] + p[1])
        start = len(prompt) - 1
        assert batch[C.LOSS_MASK][row, start:start + len(rest)].tolist() == [float(m) for m in mask]
        assert batch[C.LOSS_MASK][row].sum() == sum(mask)
    plain = sft_rows([(p, r) for p, r, _ in pairs], batch_size=8, step=1, seed=0, pad_id=0)
    assert plain[C.LOSS_MASK].sum() == sum(len(pairs[i][1]) for i in _rows(plain, pairs))


def _rows(batch, pairs):
    from xray.data import columns as C

    return [next(i for i, p in enumerate(pairs) if batch[C.INPUT_IDS][row, :len(p[0]) + len(p[1])].tolist() == p[0] + p[1])
            for row in range(len(batch))]
