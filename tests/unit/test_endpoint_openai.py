"""OpenAI function calling, streaming, stop strings, log-probs, models and errors through the
agent endpoint (`xray/run/episodes/endpoint.py`), driven by the real `openai` client over HTTP
against a scripted engine (no Ray, no model: each answer is a fixed text's token ids with made-up
log-probs), with the real SmolLM2 tokenizer (ChatML).

The parser (`tool_calls.py`) on real `<tool_call>` text; the stream's chunks (`sse.py`) as the
client assembles them; the error shape; token exactness: the trajectory is the prompt, the
engine's ids, and for each later request exactly the template's text after the last answer
(`<|im_end|>` not doubled, the newline after it kept), tool turns out of the loss; a Qwen3-style
template that strips `<think>` from past turns keeps the engine's `<think>` tokens.
"""
import asyncio
import json

import pytest

from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS
from xray.data import columns as C
from xray.data.chat import ChatFormat
from xray.data.trajectory import TrajectoryLimits
from xray.run.episodes import sse
from xray.run.episodes.endpoint import AgentEndpoint
from xray.run.episodes.openai_messages import ChatRequest, OpenAIError
from xray.run.episodes.tool_calls import HermesParser, ParsedCall, tool_parser

pytestmark = pytest.mark.unit

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CHATML_TOOLS = ROOT / "configs/chat_templates/chatml_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function",
            "function": {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
"""What SmolLM2-135M-Instruct wrote, greedy, after three examples (the real-model test's prompt)."""


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


class Scripted:
    """An engine whose answer to a prompt is the text of the first `(marker, text)` whose marker is in
    the prompt's last 100 characters (`*`: any), then the end-of-turn token (unless `eos` is off);
    log-probs -0.1, -0.2, ..."""

    def __init__(self, tok, script, eos=True, delay=0.0):
        self.tok, self.script, self.eos, self.delay, self.calls = tok, script, eos, delay, []

    async def generate(self, prompts, sampling):
        await asyncio.sleep(self.delay)
        self.calls.append(([list(p) for p in prompts], dict(sampling)))
        ids = []
        for p in prompts:
            text = self.tok.decode(p)
            answer = next(a for marker, a in self.script if marker in text[-100:] or marker == "*")
            end = [self.tok.eos_token_id] if self.eos else []
            ids.append(self.tok(answer, add_special_tokens=False).input_ids + end)
        return {C.RESPONSE_IDS: ids, RESPONSE_LOGPROBS: [[-0.1 * (k + 1) for k in range(len(r))] for r in ids],
                FINISH_REASON: ["stop" if self.eos else "length"] * len(ids)}


def serve(endpoint, agent):
    """Run `agent(endpoint)` (async) with the endpoint serving; its result."""
    async def main():
        await endpoint.start()
        try:
            return await agent(endpoint)
        finally:
            await endpoint.stop()
    return asyncio.run(main())


def client(url):
    import openai

    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


def endpoint_of(tok, engine, template=CHATML_TOOLS, kwargs=None, **limits):
    chat = ChatFormat(str(template), dict(kwargs or {}))
    limits = TrajectoryLimits(**{"max_turns": 4, "max_turn_tokens": 64, "max_tokens": 600, **limits})
    return AgentEndpoint(engine, tok, limits,
                         {"temperature": 0.0, "stop_token_ids": [tok.eos_token_id]}, chat=chat)


# -- the parser --------------------------------------------------------------------------------------
def test_hermes_parser_on_real_tool_call_text():
    parser = tool_parser("hermes")
    answer = parser.parse(CALL)
    assert answer.content is None and answer.calls == [ParsedCall("get_weather", '{"city": "Paris"}')]
    add = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    two = parser.parse('Let me look.\n' + CALL + '\n' + add)
    assert two.content == "Let me look." and [c.name for c in two.calls] == ["get_weather", "add"]
    assert json.loads(two.calls[1].arguments) == {"a": 1}  # a JSON text as arguments: kept as written
    unclosed = parser.parse('<tool_call>\n{"name": "f", "arguments": {}}')  # ended on its stop token
    assert unclosed.calls == [ParsedCall("f", "{}")]
    for broken in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>["f"]</tool_call>',
                   '<tool_call>{"arguments": {}}</tool_call>'):
        assert parser.parse(broken).calls == [] and parser.parse(broken).content == broken  # text, not a guess
    assert parser.parse("It is sunny.").calls == [] and parser.parse("").content is None
    assert tool_parser("qwen").parse(CALL) == answer and isinstance(tool_parser("qwen"), HermesParser)
    with pytest.raises(ValueError, match="register_tool_parser"):
        tool_parser("mistral")


# -- the wire format ----------------------------------------------------------------------------------
def test_sse_chunks_and_error_shape():
    answer = {"id": "c1", "object": "chat.completion", "created": 5, "model": "policy",
              "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
                  "role": "assistant", "content": "ok", "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    body = sse.stream_body(answer, include_usage=True)
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "c1" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "ok"},
                      {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5

    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
                        ({"messages": [{"role": "user", "content": "a"}], "tools": WEATHER,
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                        ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
                        ({"messages": [{"role": "user", "content": "a"}], "stop": [1]}, "stop")):
        with pytest.raises(OpenAIError) as err:
            ChatRequest.of(body)
        shape = err.value.body()
        assert set(shape) == {"error"} and set(shape["error"]) == {"message", "type", "param", "code"}
        assert shape["error"]["param"] == param and shape["error"]["type"] == "invalid_request_error"
        assert err.value.status == 400 and shape["error"]["message"]


# -- through the endpoint -----------------------------------------------------------------------------
def tool_agent(stream: bool):
    """An agent as its author writes it: tools, read `tool_calls`, answer each with a `role: tool`
    message, ask again (streamed: the client assembles the chunks)."""
    async def run(url):
        c = client(url)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        replies = []
        for _ in range(2):
            if stream:
                async with c.chat.completions.stream(model="policy", messages=messages, tools=WEATHER) as s:
                    reply = await s.get_final_completion()
            else:
                reply = await c.chat.completions.create(model="policy", messages=messages, tools=WEATHER,
                                                        logprobs=True, top_logprobs=2)
            replies.append(reply)
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, exclude={"parsed"}))
            for call in msg.tool_calls or []:
                city = json.loads(call.function.arguments)["city"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"})
            if not msg.tool_calls:
                break
        await c.close()
        return replies
    return run


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_function_calling_is_token_exact(tok, stream):
    engine = Scripted(tok, [("</tool_response><|im_end|>\n<|im_start|>assistant", "It is sunny in Paris."),
                            ("*", CALL)])
    endpoint = endpoint_of(tok, engine)

    async def agent(ep):
        sid, url = ep.open()
        replies = await tool_agent(stream)(url)
        return replies, ep.close(sid)[0]

    replies, t = serve(endpoint, agent)
    first, second = (r.choices[0] for r in replies)
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather",
                                                                                    {"city": "Paris"})
    assert second.finish_reason == "stop" and second.message.content == "It is sunny in Paris."
    if not stream:
        assert [e.token for e in first.logprobs.content] == [tok.decode([i]) for i in t.tokens[slice(*t.turns[0])]]
        assert [e.logprob for e in first.logprobs.content] == pytest.approx(t.logprobs[slice(*t.turns[0])])
        assert all(len(e.top_logprobs) == 1 for e in first.logprobs.content)  # the chosen token: all the engine gives

    prompt = tok.decode(t.prompt_ids)
    assert "<tools>\n" + json.dumps(WEATHER[0]) in prompt and prompt.endswith("<|im_start|>assistant\n")
    call_ids = tok(CALL, add_special_tokens=False).input_ids + [tok.eos_token_id]
    observation = tok("\n<|im_start|>user\n<tool_response>\nsunny in Paris\n</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False).input_ids
    answer = tok("It is sunny in Paris.", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert t.tokens == call_ids + observation + answer  # the engine's ids, the tool turn rendered alone
    assert t.mask == [1] * len(call_ids) + [0] * len(observation) + [1] * len(answer)
    assert t.logprobs[len(call_ids):len(call_ids) + len(observation)] == [0.0] * len(observation)
    assert [p for p, _ in engine.calls] == [[t.prompt_ids], [t.prompt_ids + call_ids + observation]]


QWEN3_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or message.role == "system" %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}{%- set reasoning = '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}{%- set f = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
"""Qwen3's chat template, shortened: past assistant turns lose their `<think>` once a user turn follows."""


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_template_that_strips_think_from_history_is_token_exact(tok, tmp_path, thinking):
    path = tmp_path / "qwen3.jinja"
    path.write_text(QWEN3_STYLE)
    add = ('<think>\nI should call add.\n</think>\n\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    engine = Scripted(tok, [("And 5+5?<|im_end|>\n<|im_start|>assistant", "<think>\nEasy.\n</think>\n\n10"),
                            ("</tool_response><|im_end|>\n<|im_start|>assistant",
                             "<think>\nGot it.\n</think>\n\nIt is 5."),
                            ("*", add)])
    gen = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    endpoint = endpoint_of(tok, engine, path, {} if thinking else {"enable_thinking": False})
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def agent(ep):
        sid, url = ep.open()
        c = client(url)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        for _ in range(3):
            reply = (await c.chat.completions.create(model="policy", messages=messages, tools=tools)).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"})
            elif len(messages) < 5:
                messages.append({"role": "user", "content": "And 5+5?"})
        await c.close()
        return messages, ep.close(sid)[0]

    messages, t = serve(endpoint, agent)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "<think>\nI should call add.\n</think>" and messages[-1]["content"].endswith("10")
    # the template rewrites history: the whole conversation rendered again is not the trajectory's text
    from xray.run.episodes.openai_messages import for_template, message
    canon = [for_template(message(i, m)) for i, m in enumerate(messages)]
    again = tok.apply_chat_template(canon, tools=tools, chat_template=QWEN3_STYLE, tokenize=False)
    assert "I should call add" not in again and "I should call add" in tok.decode(t.ids)

    turns = [tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id] for a in (
        add, "<think>\nGot it.\n</think>\n\nIt is 5.", "<think>\nEasy.\n</think>\n\n10")]
    observations = [tok(text, add_special_tokens=False).input_ids for text in (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" + gen,
        "\n<|im_start|>user\nAnd 5+5?<|im_end|>\n" + gen)]
    first = tok.apply_chat_template(canon[:1], tools=tools, chat_template=QWEN3_STYLE, tokenize=False,
                                    add_generation_prompt=True, **({} if thinking else {"enable_thinking": False}))
    assert t.prompt_ids == tok(first, add_special_tokens=False).input_ids
    assert t.tokens == turns[0] + observations[0] + turns[1] + observations[1] + turns[2]
    assert t.mask == [1] * len(turns[0]) + [0] * len(observations[0]) + [1] * len(turns[1]) + \
        [0] * len(observations[1]) + [1] * len(turns[2])


def test_stop_strings_models_errors_and_session_order(tok):
    engine = Scripted(tok, [("*", "one. two. three.")])
    endpoint = endpoint_of(tok, engine)

    async def agent(ep):
        import aiohttp
        import openai

        sid, url = ep.open()
        c = client(url)
        listed = await c.models.list()
        reply = await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "count"}],
                                                stop=[" two"])
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{ep.address}/sessions/nope/v1/chat/completions", json={"messages": []}) as r:
                missing = (r.status, await r.json())
            async with http.post(f"{url}/chat/completions", data=b"{not json") as r:
                broken = (r.status, await r.json())
            async with http.get(f"{ep.address}/v1/models") as r:
                root_models = await r.json()
        with pytest.raises(openai.BadRequestError) as err:  # the history rewritten
            await c.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "count"}, {"role": "assistant", "content": "one. two."},
                {"role": "user", "content": "more"}])
        # two requests of one session at once: served one after the other (the second refused: its
        # history lacks the first's answer), never both on the same trajectory
        sid2, url2 = ep.open()
        c2 = client(url2)
        both = await asyncio.gather(*[c2.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "go"}]) for _ in range(2)], return_exceptions=True)
        await c.close()
        await c2.close()
        return listed, reply, missing, broken, root_models, err.value, both, ep.close(sid)[0], ep.close(sid2)[0]

    with pytest.raises(OpenAIError, match="does not render them") as err:  # SmolLM2's own template drops tools
        AgentEndpoint(engine, tok, TrajectoryLimits(), {}, chat=ChatFormat()).check_tools(WEATHER)
    assert err.value.body()["error"]["code"] == "tools_not_rendered"
    listed, reply, missing, broken, root_models, refused, both, t, t2 = serve(endpoint, agent)
    assert [m.id for m in listed.data] == ["policy"] and root_models["data"][0]["id"] == "policy"
    assert reply.choices[0].message.content == "one." and reply.choices[0].finish_reason == "stop"
    kept = t.tokens[slice(*t.turns[0])]
    assert tok.decode(kept).endswith(" two") and tok.decode(kept[:-1]) == "one."  # cut after the completing token
    assert missing[0] == 404 and missing[1]["error"]["code"] == "session_not_found"
    assert broken[0] == 400 and set(broken[1]["error"]) == {"message", "type", "param", "code"}
    assert refused.status_code == 400
    assert (refused.body["param"], refused.body["code"]) == ("messages", "history_changed")
    assert sum(isinstance(b, Exception) for b in both) == 1 and len(t2.turns) == 1


def test_a_cancelled_request_does_not_hang_its_batch(tok):
    """One client gives up while its request waits on the engine: the others of that generate call
    are answered, its session records nothing and takes its next request."""
    engine = Scripted(tok, [("*", "ok")], delay=0.5)
    endpoint = endpoint_of(tok, engine)

    async def agent(ep):
        import openai

        sessions = [ep.open() for _ in range(3)]
        clients = [client(url) for _, url in sessions]
        ask = [{"role": "user", "content": "hi"}]
        quitter = clients[0].chat.completions.create(model="policy", messages=ask, timeout=0.2)
        results = await asyncio.wait_for(asyncio.gather(quitter, *[c.chat.completions.create(
            model="policy", messages=ask) for c in clients[1:]], return_exceptions=True), 10)
        assert isinstance(results[0], openai.APITimeoutError), results[0]
        await asyncio.sleep(0.6)  # the engine answers the cancelled request: dropped
        again = await asyncio.wait_for(clients[0].chat.completions.create(model="policy", messages=ask), 10)
        for c in clients:
            await c.close()
        return results, again, [ep.close(sid)[0] for sid, _ in sessions]

    results, again, trajectories = serve(endpoint, agent)
    assert [r.choices[0].message.content for r in results[1:]] == ["ok", "ok"]
    assert again.choices[0].message.content == "ok"
    assert [len(t.turns) for t in trajectories] == [1, 1, 1]  # the cancelled one left nothing behind


def test_tool_choice_none_and_changed_tools(tok):
    """`tool_choice: none`: the call's text is the content, nothing parsed; a later request of the
    session with other tools is refused (the prompt the model saw holds the first ones)."""
    endpoint = endpoint_of(tok, Scripted(tok, [("*", CALL)]))

    async def agent(ep):
        import openai

        _, url = ep.open()
        c = client(url)
        ask = [{"role": "user", "content": "Paris?"}]
        reply = await c.chat.completions.create(model="policy", messages=ask, tools=WEATHER, tool_choice="none")
        other = [dict(WEATHER[0], function=dict(WEATHER[0]["function"], name="get_time"))]
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model="policy", tools=other, messages=ask + [
                reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}])
        await c.close()
        return reply.choices[0], err.value

    choice, refused = serve(endpoint, agent)
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", CALL, None)
    assert refused.body["param"] == "tools"
