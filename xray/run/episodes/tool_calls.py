"""Tool calls in a model's answer, parsed into OpenAI's `tool_calls`: the endpoint's parsers, by name.

Sits beside the OpenAI-compatible endpoint (`xray/run/episodes/endpoint.py`), which asks the
parser its run names (`env.tool_parser`) to split each answer's text into the content and the
calls, in the format the chat template taught the model. A parser only reads text: the answer's
tokens stay the engine's, whatever it finds.

- `hermes` (also `qwen`: Qwen2.5, Qwen3 and Hermes templates write the same):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere in the text.

Register another with `register_tool_parser(name, parser)`: any object with
`parse(text) -> ParsedAnswer`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as a JSON object's text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer's text split: the content outside the calls (None when nothing is left) and the calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedAnswer: ...


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (the last one may be unclosed: the turn ended on its
    stop token). A block that is not a JSON object with a string `name` makes the whole answer plain
    content, as vLLM's Hermes parser does: a half-formed call is text, never a guessed call."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.block = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        if self.open_tag not in text:
            return ParsedAnswer(text or None)
        calls = []
        for body in self.block.findall(text):
            call = _json_call(body)
            if call is None:
                return ParsedAnswer(text or None)
            calls.append(call)
        content = self.block.sub("", text).strip()
        return ParsedAnswer(content or None, calls)


def _json_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already a JSON text: kept as the model wrote it if it parses
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return None
        return ParsedCall(value["name"], arguments)
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


TOOL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "qwen": HermesParser()}
"""The parsers `env.tool_parser` names."""


def register_tool_parser(name: str, parser: ToolCallParser) -> None:
    """Make `parser` available as `env.tool_parser: <name>`."""
    if not callable(getattr(parser, "parse", None)):
        raise TypeError(f"tool parser {name!r} has no parse(text) method; give an object with "
                        "parse(text) -> ParsedAnswer")
    TOOL_PARSERS[name] = parser


def tool_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"env.tool_parser={name!r} is not a registered tool-call parser; give one of "
                         f"{sorted(TOOL_PARSERS)} or register yours (xray.run.episodes.tool_calls."
                         "register_tool_parser)") from None
