"""Episodes in the model's chat format (`xray/run/episodes/runner.py` with a chat template, rendered by
`xray/data/chat_delta.py` as the agent endpoint renders an agent's messages), with the real SmolLM2
tokenizer (ChatML) and a scripted engine (no Ray, no model: each generate call answers with the
script's next text as token ids, with made-up log-probs).

A built-in tool episode is exactly the prompt rendered with the tool's schema, the engine's tokens
of the call's turn up to `</tool_call>`, the template's end of that turn, its tool turn and its
generation prompt (out of the loss), then the engine's answer; an end-of-turn token the engine
produced is not written again; the calculator's chat demonstrations are, token for token, the
runner's trajectory of that episode; a template that drops `tools` is refused with the fix; and a
tokenizer without a template (the built-in character model's) keeps the plain-text layout.
"""
import asyncio
import json
from pathlib import Path

import pytest

from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS
from xray.data import columns as C
from xray.data.chat import ChatFormat, PromptRenderer
from xray.data.trajectory import TrajectoryLimits
from xray.env.base import EnvError, GuessEnv, ToolEnv
from xray.env.tasks import CalculatorEnv, calculator_tools, demonstration_ids
from xray.env.tools import ToolFormat
from xray.run.episodes.runner import EpisodeRunner

pytestmark = pytest.mark.unit

CHATML_TOOLS = Path(__file__).resolve().parents[2] / "configs/chat_templates/chatml_tools.jinja"
QUESTION = "What is 1234 * 5678?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
LIMITS = TrajectoryLimits(max_turns=4, max_turn_tokens=64, max_tokens=1000)


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


class Scripted:
    """An engine answering its k-th generate call with `script[k]` (token ids, or text tokenized
    alone) for every prompt; log-probs -0.1, -0.2, ...; every call's prompts and sampling kept."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    async def generate(self, prompts, sampling):
        answer = self.script[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], dict(sampling)))
        ids = answer if isinstance(answer, list) else self.tok(answer, add_special_tokens=False).input_ids
        return {C.RESPONSE_IDS: [list(ids)] * len(prompts),
                RESPONSE_LOGPROBS: [[-0.1 * (k + 1) for k in range(len(ids))]] * len(prompts),
                FINISH_REASON: ["stop"] * len(prompts)}


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def play(tok, engine, make_env, rows, chat):
    runner = EpisodeRunner(engine, tok, make_env, LIMITS, {"temperature": 0.0, "stop_token_ids": [tok.eos_token_id]},
                           chat=chat)
    return asyncio.run(runner.run(rows))


def reward(row, text):
    return float(row["answer"] in text)


def test_a_tool_episode_is_the_templates_format(tok):
    """Prompt (with the tool's schema) + the engine's call up to `</tool_call>` (what it wrote after,
    its `<|im_end|>` included, cut) + the template's `<|im_end|>` and tool turn and generation prompt
    (mask 0, log-prob 0) + the engine's answer with its own `<|im_end|>`."""
    eos = tok.eos_token_id
    engine = Scripted(tok, [ids(tok, CALL) + [eos] + ids(tok, " and more"), ids(tok, "It is 7006652.") + [eos]])
    env = lambda: ToolEnv(tools=["builtin:calculator"], reward=reward, format="hermes")  # noqa: E731
    chat = ChatFormat(template=str(CHATML_TOOLS))
    [t] = play(tok, engine, env, [{"prompt": QUESTION, "answer": "7006652"}], chat)

    schema = calculator_tools().schemas()
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tools=schema, tokenize=False,
                                     chat_template=CHATML_TOOLS.read_text(), add_generation_prompt=True)
    assert t.prompt_ids == ids(tok, prompt) and json.dumps(schema[0]) in tok.decode(t.prompt_ids)
    call = ids(tok, CALL)
    tool_turn = ids(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n7006652\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    answer = ids(tok, "It is 7006652.") + [eos]
    assert t.tokens == call + tool_turn + answer
    assert t.mask == [1] * len(call) + [0] * len(tool_turn) + [1] * len(answer)
    assert t.logprobs == pytest.approx([-0.1 * (k + 1) for k in range(len(call))] + [0.0] * len(tool_turn)
                                       + [-0.1 * (k + 1) for k in range(len(answer))])
    assert t.turns == [(0, len(call)), (len(call) + len(tool_turn), len(t.tokens))]
    assert (t.end, t.rewards, t.info) == ("done", [0.0, 1.0], {"tool_calls": 1})
    assert [p for p, _ in engine.calls] == [[t.prompt_ids], [t.prompt_ids + call + tool_turn]]
    assert engine.calls[0][1]["stop"] == ["</tool_call>"]
    # the whole trajectory is the template's rendering of the conversation (its last newline aside)
    whole = tok.apply_chat_template([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL},
                                     {"role": "tool", "content": "7006652"},
                                     {"role": "assistant", "content": "It is 7006652."}], tools=schema,
                                    tokenize=False, chat_template=CHATML_TOOLS.read_text())
    assert tok.decode(t.ids) + "\n" == whole and tok.decode(t.ids).count("<|im_end|>") == whole.count("<|im_end|>")


def test_the_engines_end_of_turn_is_not_doubled(tok):
    """A text observation is a user turn; after a turn the engine closed with `<|im_end|>` the
    observation starts with the newline after it, after a turn cut at its length with `<|im_end|>`."""
    eos = tok.eos_token_id
    engine = Scripted(tok, [ids(tok, "50") + [eos], ids(tok, "60"), ids(tok, "70") + [eos]])
    chat = ChatFormat()  # SmolLM2's own template: the game has no tools
    rows = [{"prompt": "Guess my number.", "secret": 70}]
    rows[0]["prompt_ids"] = PromptRenderer(tok, chat).ids(rows[0]["prompt"])
    [t] = play(tok, engine, GuessEnv, rows, chat)

    after_eos = ids(tok, "\n<|im_start|>user\n higher\n<|im_end|>\n<|im_start|>assistant\n")
    after_cut = ids(tok, "<|im_end|>\n<|im_start|>user\n higher\n<|im_end|>\n<|im_start|>assistant\n")
    assert t.prompt_ids == rows[0]["prompt_ids"]
    assert t.tokens == ids(tok, "50") + [eos] + after_eos + ids(tok, "60") + after_cut + ids(tok, "70") + [eos]
    assert [t.mask[s:e] for s, e in t.turns] == [[1] * (e - s) for s, e in t.turns]
    assert t.mask.count(1) == len(ids(tok, "50") + ids(tok, "60") + ids(tok, "70")) + 2
    assert (t.end, t.rewards) == ("done", [0.0, 0.0, 1.0])


@pytest.mark.parametrize("style", ["hermes", "compact"])
def test_the_chat_demonstration_is_the_runners_trajectory(tok, style):
    """The warm start's demonstration of a calculator episode (`demonstration_ids` with a chat
    template) has the ids the runner's trajectory of that episode has when the engine writes the
    demonstration's turns; the masks differ only at the call turn's `<|im_end|>` (trained in the
    demonstration; in the trajectory the template's, after the stop string's cut)."""
    chat = ChatFormat(template=str(CHATML_TOOLS))
    fmt = ToolFormat(style=style)
    row = {"prompt": "q: 4821*37=?", "answer": "178377", "expression": "4821*37"}
    demo, mask = demonstration_ids(row, tok, fmt, chat)
    turns, start = [], mask.index(1)
    while start < len(mask):  # each trained run of the demonstration is one engine turn
        end = next((k for k in range(start, len(mask)) if not mask[k]), len(mask))
        turns.append(demo[start:end])
        start = next((k for k in range(end, len(mask)) if mask[k]), len(mask))
    engine = Scripted(tok, turns)
    [t] = play(tok, engine, lambda: CalculatorEnv(format=fmt), [row], chat)
    assert (t.end, t.rewards) == ("done", [0.0, 1.0])
    assert t.ids == demo
    differ = [k for k, (a, b) in enumerate(zip(mask[len(t.prompt_ids):], t.mask)) if a != b]
    assert [t.tokens[k] for k in differ] == [tok.eos_token_id] and differ == [t.turns[0][1]]
    text = tok.decode(demo)
    assert text.count("<|im_start|>assistant\n") == 2 and "<tool_response>\n178377\n</tool_response>" in text


def test_a_template_that_drops_tools_is_refused_with_the_fix(tok):
    engine = Scripted(tok, [CALL])
    with pytest.raises(EnvError, match="chatml_tools.jinja"):
        play(tok, engine, lambda: ToolEnv(tools=["builtin:calculator"], reward=reward), [{"prompt": QUESTION}],
             ChatFormat())
    assert engine.calls == []


def test_without_a_template_the_layout_is_plain_text():
    """The built-in character tokenizer has no chat template: the call cut at `</tool_call>`, the
    tool's answer tokenized alone in its response tags, nothing else added."""
    from xray.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    call = "<tool_call>calculator: 4821*37</tool_call>"
    engine = Scripted(tok, [ids(tok, call) + [tok.eos_token_id], ids(tok, "178377") + [tok.eos_token_id]])
    row = {"prompt": "q: 4821*37=?", "answer": "178377", "expression": "4821*37"}
    row["prompt_ids"] = tok(row["prompt"]).input_ids
    [t] = play(tok, engine, CalculatorEnv, [row], ChatFormat())
    tool = ids(tok, "<tool_response>178377</tool_response>")
    assert t.prompt_ids == row["prompt_ids"]
    assert t.tokens == ids(tok, call) + tool + ids(tok, "178377") + [tok.eos_token_id]
    assert t.mask == [1] * len(ids(tok, call)) + [0] * len(tool) + [1] * 7 and t.rewards == [0.0, 1.0]
