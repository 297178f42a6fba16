"""Built-in tool-use tasks: `builtin:calculator`, multi-digit arithmetic the model answers by calling
the calculator, written so that the built-in character tokenizer (`xray/data/tokenizer.py`) can
write every call and read every answer.

    prompt      q: 4821*37=?
    model       <tool_call>calculator: 4821*37</tool_call>          (then end-of-sequence)
    tool        <tool_response>178377</tool_response>
    model       178377                                              (then end-of-sequence)

`CalculatorTask.rows` draws the prompts (seeded: the same seed gives the same rows), with their
`answer` and `expression`; `CalculatorEnv` (`builtin:calculator`) is a `ToolEnv` with the
calculator tool and the compact call format (`xray/env/tools.py`), scored by `calculator_reward`;
`demonstration` / `demonstration_ids` give the episode above as text segments or as token ids with
a loss mask on the model's tokens only: what a supervised warm start trains on, laid out exactly as
`xray/run/episodes/runner.py` lays out a trajectory (prompt, each turn ending with end-of-sequence, each
answer tokenized alone). With a chat template (a tokenizer's own, or `data.chat_template`), the same
episode in the model's chat format (`chat_demonstration_ids`): the prompt rendered with the
calculator's schema, the call and the answer as the template writes an assistant's turns, the tool's
answer as its tool turn, token for token what the runner's trajectory of that episode holds.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from xray.data.chat import ChatFormat
from xray.env.base import ToolEnv
from xray.env.tools import ToolCall, ToolFormat, ToolRegistry, calculate

COMPACT = ToolFormat(style="compact")
"""The call format of the built-in tool tasks: `<tool_call>calculator: 12*34</tool_call>`."""


class CalculatorTaskError(ValueError):
    """A calculator task configured wrong: says what to change."""


@dataclass(frozen=True)
class CalculatorTask:
    """Arithmetic on an `a_digits`-digit and a `b_digits`-digit number with one of `ops`."""

    a_digits: int = 4
    """Digits of the first operand (no leading zero)."""
    b_digits: int = 2
    """Digits of the second operand (no leading zero)."""
    ops: tuple[str, ...] = ("+", "-", "*")
    """Operators drawn from (each `+`, `-` or `*`)."""

    def __post_init__(self) -> None:
        if self.a_digits < 1 or self.b_digits < 1:
            raise CalculatorTaskError(f"a_digits={self.a_digits} and b_digits={self.b_digits} must be >= 1")
        if not self.ops or set(self.ops) - {"+", "-", "*"}:
            raise CalculatorTaskError(f"ops={self.ops!r}: choose one or more of '+', '-', '*'")

    def rows(self, count: int, seed: int = 0) -> list[dict[str, str]]:
        """`count` rows `{"prompt": "q: 4821*37=?", "answer": "178377", "expression": "4821*37"}`."""
        rng = random.Random(seed)
        rows = []
        for _ in range(count):
            a = rng.randrange(10 ** (self.a_digits - 1), 10 ** self.a_digits)
            b = rng.randrange(10 ** (self.b_digits - 1), 10 ** self.b_digits)
            expression = f"{a}{rng.choice(self.ops)}{b}"
            rows.append({"prompt": f"q: {expression}=?", "answer": calculate(expression), "expression": expression})
        return rows


def calculator_reward(row: dict, text: str) -> float:
    """1.0 when the final turn's text holds the row's `answer` as a whole number (not inside a longer
    one: `178377` is not found in `1783771`), else 0.0."""
    pattern = r"(?<![\d-])" + re.escape(str(row["answer"])) + r"(?!\d)"
    return 1.0 if re.search(pattern, text) else 0.0


def calculator_tools() -> ToolRegistry:
    """A registry with the built-in calculator alone."""
    return ToolRegistry.from_specs(["builtin:calculator"])


@dataclass
class CalculatorEnv(ToolEnv):
    """`builtin:calculator`: a `ToolEnv` with the calculator, compact calls and `calculator_reward`
    (pass `tools=` to wrap the calculator, e.g. with a latency)."""

    tools: Any = field(default_factory=calculator_tools)
    reward: Callable[[dict, str], float] = calculator_reward
    format: Any = COMPACT


def _call(row: dict, fmt: ToolFormat) -> ToolCall:
    """The calculator call that solves `row`, in `fmt`'s style."""
    if fmt.style == "compact":
        return ToolCall("calculator", text=row["expression"])
    return ToolCall("calculator", {"expression": row["expression"]})


def demonstration(row: dict, fmt: ToolFormat = COMPACT) -> list[tuple[str, bool]]:
    """The row's episode solved with one calculator call, as `(text, written_by_the_model)` segments:
    the prompt, the call, the tool's answer, the final answer (each model segment is one turn)."""
    return [(row["prompt"], False), (fmt.write(_call(row, fmt)), True),
            (fmt.response(calculate(row["expression"])), False), (str(row["answer"]), True)]


def demonstration_ids(row: dict, tokenizer: Any, fmt: ToolFormat = COMPACT,
                      chat: ChatFormat = ChatFormat()) -> tuple[list[int], list[int]]:
    """`demonstration(row)` as token ids and a loss mask (1 on model tokens): the prompt with the
    tokenizer's special tokens (its begin-of-sequence), every other segment tokenized alone, each
    model turn closed by the tokenizer's end-of-sequence. With a chat template (`chat`: the run's
    settings), the episode in its chat format instead (`chat_demonstration_ids`)."""
    template = chat.template_text(tokenizer)
    if template is not None:
        return chat_demonstration_ids(row, tokenizer, fmt, chat, template)
    ids: list[int] = []
    mask: list[int] = []
    for k, (text, trained) in enumerate(demonstration(row, fmt)):
        part = list(tokenizer(text, add_special_tokens=k == 0).input_ids)
        if trained:
            part.append(int(tokenizer.eos_token_id))
        ids += part
        mask += [int(trained)] * len(part)
    return ids, mask


def chat_demonstration_ids(row: dict, tokenizer: Any, fmt: ToolFormat, chat: ChatFormat,
                           template: str) -> tuple[list[int], list[int]]:
    """The row's episode in `template`'s chat format, as ids and a loss mask, laid out as the episode
    runner lays out its trajectory (`xray/data/chat_delta.py`): the prompt rendered with the
    calculator's schema; the call's turn and the answer's, as the template writes an assistant's
    message (a Hermes call as its `tool_calls`, a compact one as its text), trained, each closed by
    the tokenizer's end-of-sequence where that is the template's end of turn (what a model stopped
    on it produced); between them, not trained, the rest of the call turn's markup, the tool's
    answer as the template's tool turn and the generation prompt."""
    from xray.data.chat import PromptRenderer
    from xray.data.chat_delta import ChatRenderer, Conversation

    renderer, tools = ChatRenderer(tokenizer, template, chat.kwargs), calculator_tools().schemas()
    if not renderer.renders_tools:
        raise CalculatorTaskError("the chat template does not render `tools`, so the calculator's schema would not "
                                  "reach the prompt; give data.chat_template a template that renders them (e.g. "
                                  "configs/chat_templates/chatml_tools.jinja for a ChatML model), or none")
    conversation = Conversation(renderer, PromptRenderer(tokenizer, chat).messages(row["prompt"]), tools)
    ids = conversation.prompt_ids()
    mask = [0] * len(ids)
    call = _call(row, fmt)
    asks = {"role": "assistant", "content": fmt.write(call)} if call.text is not None else {
        "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]}
    tool_turn = [{"role": "tool", "content": calculate(row["expression"]), "name": "calculator"}]
    eos = tokenizer.eos_token or ""
    for message, observation in ((asks, tool_turn), ({"role": "assistant", "content": str(row["answer"])}, [])):
        text = renderer.answer_text(conversation.messages, message, tools)
        part = renderer.ids((message["content"] or fmt.write(call)) if text is None else text)
        closing = renderer.after_answer(conversation.messages + [message], [], tools, generation_prompt=False)
        end = eos if eos and closing.startswith(eos) else ""
        part += [int(tokenizer.eos_token_id)] if end else []
        conversation.answered(message, end)
        seen = conversation.observe(observation) if observation else []
        ids += part + seen
        mask += [1] * len(part) + [0] * len(seen)
    return ids, mask
