"""Tools (`xray/env/tools.py`): Hermes-style and compact calls parsed and written, the calculator
exact and safe, and every failure of a call answered as text the model reads."""
import asyncio

import pytest

from xray.env.tools import ToolCall, ToolError, ToolFormat, ToolRegistry, calculate

pytestmark = pytest.mark.unit


def test_calls_are_found_in_order_and_bad_ones_say_why():
    fmt = ToolFormat()
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>["calculator"]</tool_call>')
    calls = fmt.calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("python", {"code": "print(1)"})]
    assert calls[2].startswith("error: the tool call is not valid JSON") and "JSON object" in calls[3]
    assert fmt.calls("no call here") == []
    assert fmt.response("5") == "<tool_response>\n5\n</tool_response>"
    custom = ToolFormat("[CALL]", "[/CALL]", "[OUT]", "[/OUT]")
    assert custom.calls('[CALL]{"name": "f"}[/CALL]') == [ToolCall("f", {})]


def test_compact_calls_use_only_the_character_vocabulary_and_reach_the_tool():
    from xray.data.tokenizer import CHARS

    fmt = ToolFormat(style="compact")
    text = ("so <tool_call>calculator: 123*456</tool_call><tool_call> python :print(1)</tool_call>"
            "<tool_call>no colon</tool_call>")
    calls = fmt.calls(text)
    assert calls[:2] == [ToolCall("calculator", text="123*456"), ToolCall("python", text="print(1)")]
    assert calls[2] == "error: a tool call is NAME: ARGUMENT, e.g. calculator: 12*34"
    assert fmt.calls('<tool_call>{"name": "calculator"}</tool_call>')[0].startswith("error: a tool call is NAME")
    written = fmt.write(ToolCall("calculator", text="123*456"))
    assert written == "<tool_call>calculator: 123*456</tool_call>" and fmt.calls(written) == [calls[0]]
    assert fmt.response("56088") == "<tool_response>56088</tool_response>"
    assert set(written + fmt.response("56088")) <= set(CHARS)
    assert ToolFormat(style="compact", response_separator=" ").response("7") == "<tool_response> 7 </tool_response>"
    assert ToolFormat(response_separator="").response("7") == "<tool_response>7</tool_response>"
    hermes = ToolFormat()  # the default is unchanged, and writes what it parses
    call = ToolCall("calculator", {"expression": "2+3"})
    assert hermes.calls(hermes.write(call)) == [call]
    assert hermes.response("5") == "<tool_response>\n5\n</tool_response>"
    registry = ToolRegistry.from_specs(["builtin:calculator"])
    assert asyncio.run(registry.call(calls[0])) == "56088"
    assert asyncio.run(registry.call(ToolCall("calculator", text="1+"))).startswith("error: calculator: ValueError")

    class Remote:  # an object with an async __call__ is awaited, not run in a thread
        async def __call__(self, expression: str) -> str:
            await asyncio.sleep(0)
            return f"remote {expression}"
    registry.register(Remote(), "remote")
    assert asyncio.run(registry.call(ToolCall("remote", text="1"))) == "remote 1"
    with pytest.raises(ToolError, match="unknown tool-call style 'json'.*'compact'"):
        ToolFormat(style="json")
    with pytest.raises(ToolError, match="one text argument"):
        fmt.write(ToolCall("calculator", {"expression": "1"}))


@pytest.mark.parametrize("expression, answer", [
    ("1234 * 5678", "7006652"), ("2 ** 100", "1267650600228229401496703205376"), ("(7 - 10) // 2", "-2"),
    ("1 / 3", "0.333333333333"), ("0.1 + 0.2", "0.3"), ("-(4 % 3) + 2.5", "1.5"),
])
def test_the_calculator_is_exact(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "only numbers"), ("1 / 0", "division by zero"),
    ("10 ** 100000", "exponent"), ("9 ** 9999", "digits"), ("2 +", "not an arithmetic expression"),
])
def test_the_calculator_refuses_what_is_not_small_arithmetic(expression, error):
    with pytest.raises((ValueError, ZeroDivisionError), match=error):
        calculate(expression)


@pytest.mark.parametrize("expression", ["9**9**9", "(9**999)**9999", "(10**999)**10000", "2**-10000",
                                        "(1/7)**2000", "(10**999)*(10**999)"])
def test_the_calculator_refuses_huge_numbers_before_computing_them(expression):
    """Sized before computing: each answers with an error in milliseconds (before the bound,
    `(9**999)**9999` held the interpreter, and every episode's event loop, for ~9 s)."""
    import time

    started = time.perf_counter()
    with pytest.raises(ValueError, match="exponent|digits"):
        calculate(expression)
    assert time.perf_counter() - started < 0.05
    from xray.env.tasks import calculator_tools

    answer = asyncio.run(calculator_tools().call(ToolCall("calculator", text=expression)))
    assert answer.startswith("error: calculator: ValueError")


def test_every_failure_of_a_call_is_an_answer(tmp_path):
    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "done"

    def broken(x: int) -> str:
        raise KeyError("missing")

    tools = tmp_path / "my_tools.py"
    tools.write_text("def shout(text: str) -> str:\n    return text.upper()\n")
    registry = ToolRegistry.from_specs(["builtin:calculator", f"{tools}:shout"], timeout_s=0.2)
    registry.register(slow)
    registry.register(broken)

    async def answers():
        return await asyncio.gather(*[registry.call(c) for c in (
            ToolCall("calculator", {"expression": "6 * 7"}), ToolCall("shout", {"text": "hi"}),
            ToolCall("slow", {"seconds": 5}), ToolCall("broken", {"x": 1}), ToolCall("nope", {}),
            ToolCall("calculator", {"expr": "1"}), ToolCall("calculator", {"expression": "1/0"}),
            "error: the tool call is not valid JSON")])
    out = asyncio.run(answers())
    assert out[:2] == ["42", "HI"]
    assert out[2] == "error: slow did not answer within 0.2 s"
    assert out[3] == "error: broken: KeyError: 'missing'"
    assert out[4].startswith("error: no tool named 'nope'; the tools are broken, calculator, shout, slow")
    assert out[5].startswith("error: calculator: ") and "expr" in out[5]
    assert out[6] == "error: calculator: ZeroDivisionError: division by zero"
    assert out[7] == "error: the tool call is not valid JSON"
    with pytest.raises(ToolError, match="two tools are named 'slow'"):
        registry.register(slow)
    with pytest.raises(ToolError, match="unknown built-in tool 'builtin:abacus'.*builtin:calculator, builtin:python"):
        ToolRegistry.from_specs(["builtin:abacus"])


def test_tools_give_openai_function_schemas_for_the_prompt(tmp_path):
    """`ToolRegistry.schemas` (what `apply_chat_template(tools=...)` takes): each tool's name, its
    docstring's first paragraph, its parameters typed from their annotations (required: those
    without a default); a tool's own `schema` wins."""
    async def lookup(city: str, days: int = 3, metric: bool = True):
        """Look the weather up
        for a city.

        Not this paragraph."""

    def shout(text):
        return text.upper()
    shout.schema = {"type": "function", "function": {"name": "shout", "parameters": {"type": "object"}}}
    registry = ToolRegistry.from_specs(["builtin:calculator"])
    registry.register(lookup)
    registry.register(shout)
    calculator, looked, own = registry.schemas()
    assert calculator == {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    assert looked["function"]["description"] == "Look the weather up for a city."
    assert looked["function"]["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}
    assert own is shout.schema


def test_the_python_tool_answers_through_the_sandbox():
    registry = ToolRegistry.from_specs(["builtin:python"])
    out = asyncio.run(registry.call(ToolCall("python", {"code": "print(sum(range(10)))\nimport socket\n"
                                                                "socket.create_connection(('1.1.1.1', 80), timeout=1)"})))
    assert out.startswith("45\n") and "OSError" in out and out.endswith("[exit code 1]"), out
