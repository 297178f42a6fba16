"""Tools a model calls between its turns: the call format, the registry, and the built-in tools.

A model calls a tool by writing a call in its turn; the default format is Hermes' (Qwen's and
NousResearch's chat templates use it):

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>

`ToolFormat` finds the calls in a turn's text and renders each answer as the observation the model
reads next (`<tool_response>...</tool_response>`); its tags are configurable. Its `compact` style
is for vocabularies without braces or newline (the built-in character tokenizer): a call is the
tool's name, a colon and its one argument as text, and an answer has nothing around it:

    <tool_call>calculator: 1234*5678</tool_call>    ->    <tool_response>7006652</tool_response>

`ToolRegistry` holds the tools by name: user functions (sync or async, or objects with an async
`__call__`; keyword arguments from the call's `arguments`, or a compact call's text as the one
positional argument; returning text), loaded from `path/to/file.py:function` or `module:function`
as reward functions are, and gives their OpenAI function schemas (`schemas`: what a chat template's
`tools` takes, so that the prompt shows them; `xray/run/episodes/runner.py`), and the built-ins `builtin:calculator` (exact arithmetic on integers and
fractions, no `eval`) and `builtin:python` (the sandbox: local namespaces, `xray/env/sandbox.py`, or a
remote service, `xray/env/remote_sandbox.py`, as `SandboxConfig` says). A call that fails,
in any way (unknown tool, bad arguments, an exception, a timeout) answers with the error's text:
the model sees it, the episode goes on.
"""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Awaitable, Callable

ToolFn = Callable[..., "str | Awaitable[str]"]


class ToolError(ValueError):
    """A tool registry built wrong (a name twice, an unknown built-in): says what to fix."""


@dataclass(frozen=True)
class ToolCall:
    """One call a model wrote: the tool's name and its keyword arguments, or (a compact call) its
    one argument as text."""

    name: str
    arguments: dict = field(default_factory=dict)
    text: str | None = None
    """A compact call's argument, passed as the tool's one positional argument (None: keywords)."""


STYLES = ("hermes", "compact")
"""`hermes`: a JSON object per call; `compact`: `NAME: ARGUMENT` per call."""


@dataclass(frozen=True)
class ToolFormat:
    """How calls are written and answers shown (Hermes' tags and JSON calls by default)."""

    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"
    style: str = "hermes"
    """How a call's body is written: `hermes` (JSON) or `compact` (`NAME: ARGUMENT`)."""
    response_separator: str | None = None
    """Text between an answer and its tags; None: a newline for `hermes`, nothing for `compact`."""

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ToolError(f"unknown tool-call style {self.style!r}; use 'hermes' (JSON calls) or "
                            "'compact' (NAME: ARGUMENT, for vocabularies without braces)")

    @property
    def separator(self) -> str:
        if self.response_separator is not None:
            return self.response_separator
        return "\n" if self.style == "hermes" else ""

    def calls(self, text: str) -> list[ToolCall | str]:
        """The calls in `text`, in order; one written wrong (not a JSON object with a string `name`;
        in the compact style, no `NAME:`) comes back as the text of what is wrong with it (its
        answer to the model)."""
        pattern = re.escape(self.call_open) + r"(.*?)" + re.escape(self.call_close)
        parse = _hermes_call if self.style == "hermes" else _compact_call
        return [parse(body) for body in re.findall(pattern, text, flags=re.DOTALL)]

    def write(self, call: ToolCall) -> str:
        """`call` as a model writes it (a demonstration's text)."""
        if self.style == "compact":
            if call.text is None:
                raise ToolError(f"a compact call has one text argument; build ToolCall({call.name!r}, text=...)")
            return f"{self.call_open}{call.name}: {call.text}{self.call_close}"
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"{self.call_open}{body}{self.call_close}"

    def response(self, text: str) -> str:
        """An answer as the model reads it."""
        sep = self.separator
        return f"{self.response_open}{sep}{text}{sep}{self.response_close}"


def _hermes_call(body: str) -> ToolCall | str:
    """A JSON call body: `{"name": ..., "arguments": {...}}`, or what is wrong with it."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"error: the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return f"error: the arguments of {value['name']!r} must be a JSON object"
    return ToolCall(value["name"], arguments)


def _compact_call(body: str) -> ToolCall | str:
    """A compact call body: `NAME: ARGUMENT` (the argument is the text after the first colon,
    stripped), or what is wrong with it."""
    name, colon, argument = body.partition(":")
    name = name.strip()
    if not colon or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return "error: a tool call is NAME: ARGUMENT, e.g. calculator: 12*34"
    return ToolCall(name, text=argument.strip())


class ToolRegistry:
    """Tools by name; `call` runs one under a timeout and always answers with text."""

    def __init__(self, tools: dict[str, ToolFn] | None = None, timeout_s: float = 30.0):
        self.tools: dict[str, ToolFn] = {}
        self.timeout_s = timeout_s
        for name, fn in (tools or {}).items():
            self.register(fn, name)

    @classmethod
    def from_specs(cls, specs: list[str], timeout_s: float = 30.0, sandbox: Any = None) -> "ToolRegistry":
        """`builtin:NAME` or `module:function` / `path/to/file.py:function` for each tool (named by
        the function's name); `sandbox` a `SandboxConfig` for `builtin:python` (None: the default)."""
        from xray.rewards.loader import load_callable

        registry = cls(timeout_s=timeout_s)
        for spec in specs:
            if spec.startswith("builtin:"):
                name = spec.removeprefix("builtin:")
                if name not in BUILTIN:
                    raise ToolError(f"unknown built-in tool {spec!r}; choose one of "
                                    f"{', '.join('builtin:' + n for n in sorted(BUILTIN))}")
                registry.register(BUILTIN[name](sandbox), name)
            else:
                registry.register(load_callable(spec, "tool", "path/to/tools.py:lookup"))
        return registry

    def register(self, fn: ToolFn, name: str | None = None) -> None:
        name = name or getattr(fn, "__name__", None)
        if not name:
            raise ToolError(f"tool {fn!r} has no name; pass name=")
        if name in self.tools:
            raise ToolError(f"two tools are named {name!r}; rename one")
        self.tools[name] = fn

    def schemas(self) -> list[dict]:
        """Each tool as an OpenAI function schema (`tool_schema`), in registration order."""
        return [tool_schema(name, fn) for name, fn in self.tools.items()]

    async def call(self, call: ToolCall | str) -> str:
        """The answer to `call` (a parse error's text answers itself)."""
        if isinstance(call, str):
            return call
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}"
        args = () if call.text is None else (call.text,)
        try:
            inspect.signature(fn).bind(*args, **call.arguments)
        except TypeError as exc:
            return f"error: {call.name}: {exc}"
        try:
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
                result = await asyncio.wait_for(fn(*args, **call.arguments), self.timeout_s)
            else:  # off the event loop: other episodes go on while it works
                result = await asyncio.wait_for(asyncio.to_thread(fn, *args, **call.arguments), self.timeout_s)
            return str(result)
        except asyncio.TimeoutError:
            return f"error: {call.name} did not answer within {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure is the model's observation
            return f"error: {call.name}: {type(exc).__name__}: {exc}"


_JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
               "dict": "object"}


def tool_schema(name: str, fn: ToolFn) -> dict:
    """`fn` as an OpenAI function schema: its `schema` attribute when it has one (a dict, as given),
    else its name, its docstring's first paragraph and an object of its parameters (JSON types from
    their annotations, `string` when none; those without a default required)."""
    own = getattr(fn, "schema", None)
    if isinstance(own, dict):
        return own
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        properties[p.name] = {"type": _JSON_TYPES.get(hint, "string")}
        if p.default is p.empty:
            required.append(p.name)
    description = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


# -- built-in tools ----------------------------------------------------------------------------
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_DIGITS = 1000
"""The calculator refuses numbers (numerator or denominator) longer than this, and powers whose
exponent passes 10,000 or whose result would: it sizes a power before computing it, so a call
such as `(9**999)**9999` answers with an error at once instead of holding the interpreter (and
with it every episode's event loop) for seconds."""
_MAX_BITS = int(MAX_DIGITS * 3.3219280948873626) + 1
"""`MAX_DIGITS` decimal digits in bits (log2(10) per digit), rounded up."""


def calculate(expression: str) -> str:
    """Exact arithmetic on integers and decimals: + - * / // % ** and parentheses. A whole result is
    written in full; another to 12 significant digits."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    return str(value.numerator) if value.denominator == 1 else format(float(value), ".12g")


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(Fraction(node.value) if isinstance(node.value, int) else Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _bounded(Fraction(_OPERATORS[type(node.op)](left, right)))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.dump(node)[:60]}")


def _check_power(base: Fraction, exponent: Fraction) -> None:
    """Refuse a power before computing it when its exponent is not whole or passes 10,000, or its
    result would pass `MAX_DIGITS` (sized from the base's bit lengths: a few operations whatever
    the numbers)."""
    if exponent.denominator != 1 or abs(exponent) > 10_000:
        raise ValueError("powers take a whole exponent of at most 10000")
    bits = max(abs(base.numerator).bit_length() - 1, base.denominator.bit_length() - 1)
    if bits * abs(int(exponent)) > _MAX_BITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")


def _bounded(value: Fraction) -> Fraction:
    """`value`, or an error when its numerator or denominator passes `MAX_DIGITS` digits."""
    for part in (abs(value.numerator), value.denominator):
        bits = part.bit_length()
        if bits > _MAX_BITS or (bits > _MAX_BITS - 4 and len(str(part)) > MAX_DIGITS):
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _calculator(sandbox: Any = None) -> ToolFn:
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly."""
        return calculate(expression)
    return calculator


def _python(sandbox: Any = None) -> ToolFn:
    """The sandbox tool: local (`xray/env/sandbox.py`) unless `sandbox.url` names a remote service."""
    from xray.config.sandbox import SandboxConfig

    config = sandbox or SandboxConfig()
    if config.url:
        from xray.env.remote_sandbox import RemoteSandbox

        runner: Any = RemoteSandbox(config)
    else:
        from xray.env.sandbox import PythonSandbox

        runner = PythonSandbox(config.limits)

    async def python(code: str) -> str:
        """Run a Python program in a sandbox; its output, or why it stopped."""
        return (await runner.run(code)).observation()
    return python


BUILTIN: dict[str, Callable[[Any], ToolFn]] = {"calculator": _calculator, "python": _python}
