"""OpenAI's chat-completions wire format as the endpoint reads and writes it: requests, messages, errors, answers.

Sits between the OpenAI-compatible endpoint (`xray/run/episodes/endpoint.py`, the server and the
sessions) and the `openai` client of the user's agent. Pure functions of JSON-like values:
- `ChatRequest.of(body)` checks a `POST chat/completions` body (messages, tools, tool_choice,
  stop, logprobs, top_logprobs, max_tokens, stream, n) and raises `OpenAIError` naming the
  parameter; sampling fields (temperature, top_p...) are not read: the run samples;
- `message(i, m)` is a message in one canonical form (content text or None; tool calls with their
  id, name and arguments text; `tool_call_id`, `name`), `same(a, b)` compares two such forms (the
  arguments as JSON), `for_template(m)` is the form a chat template takes (content "" for None,
  arguments as an object, as Hugging Face templates expect);
- `completion(...)` is the `chat.completion` object of one answer, `models(...)` the `/v1/models` list.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")


class OpenAIError(ValueError):
    """A request the endpoint refuses; answered in OpenAI's error shape with a 4xx status."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """The fields of one `chat/completions` body the endpoint serves."""

    messages: list[dict]
    """Canonical messages (`message`)."""
    model: str = "policy"
    tools: Optional[list[dict]] = None
    tool_choice: Any = None
    """None (auto), `none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`."""
    max_tokens: Optional[int] = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    template_kwargs: dict = field(default_factory=dict)
    """What the request adds to the template's variables (`tool_choice`)."""

    @property
    def parses_tools(self) -> bool:
        """Whether the answer's tool calls are parsed (tools given, and `tool_choice` is not `none`)."""
        return bool(self.tools) and self.tool_choice != "none"

    @classmethod
    def of(cls, body: Any) -> "ChatRequest":
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object", code="invalid_json")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise OpenAIError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        if body.get("n", 1) not in (1, None):
            raise OpenAIError("n must be 1: each sample is its own session", param="n")
        tools, choice = _tools(body.get("tools")), body.get("tool_choice")
        _check_choice(choice, tools)
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise OpenAIError(f"top_logprobs={top!r}; give an integer from 0 to 20", param="top_logprobs")
        options = body.get("stream_options") or {}
        return cls(messages=[message(i, m) for i, m in enumerate(raw)], model=str(body.get("model") or "policy"),
                   tools=tools, tool_choice=choice, max_tokens=_max_tokens(body), stop=_stops(body.get("stop")),
                   logprobs=bool(body.get("logprobs")) or top > 0, top_logprobs=top,
                   stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
                   template_kwargs={} if choice is None else {"tool_choice": choice})


def _max_tokens(body: dict) -> Optional[int]:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int) or value < 1:
                raise OpenAIError(f"{name}={value!r}; give a positive integer", param=name)
            return value
    return None


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError(f"stop={stop!r}; give a string or a list of non-empty strings", param="stop")
    return tuple(stops)


def _tools(tools: Any) -> Optional[list[dict]]:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list of {type: function, function: {name, parameters}}", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(fn, dict) and isinstance(fn.get("name"), str)
        if not named or tool.get("type", "function") != "function":
            raise OpenAIError(f"tools[{i}] is {tool!r}; each tool must be {{type: function, function: {{name, "
                              "description, parameters}}}}", param=f"tools[{i}]")
    return tools


def _check_choice(choice: Any, tools: Optional[list[dict]]) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise OpenAIError(f"tool_choice={choice!r}; give one of {TOOL_CHOICES} or "
                              "{type: function, function: {name}}", param="tool_choice")
    elif not (isinstance(choice, dict) and isinstance(choice.get("function"), dict)):
        raise OpenAIError(f"tool_choice={choice!r}; give one of {TOOL_CHOICES} or {{type: function, function: "
                          "{name}}", param="tool_choice")
    elif choice["function"].get("name") not in [t["function"]["name"] for t in tools or []]:
        raise OpenAIError(f"tool_choice names {choice['function'].get('name')!r}, which is not in 'tools'; "
                          "name one of the request's tools", param="tool_choice")
    if choice != "none" and not tools:
        raise OpenAIError("tool_choice is set but 'tools' is empty; give the tools, or drop tool_choice",
                          param="tool_choice")


def _text(i: int, content: Any) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise OpenAIError(f"messages[{i}].content is {content!r}; give a string or a list of text parts "
                      "(images and audio are not served)", param=f"messages[{i}].content")


def message(i: int, m: Any) -> dict:
    """Message `i` of a request in canonical form (module docstring)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise OpenAIError(f"messages[{i}] is {m!r}; each message needs a role, one of {ROLES}",
                          param=f"messages[{i}].role")
    out = {"role": m["role"], "content": _text(i, m.get("content"))}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_call(i, k, c) for k, c in enumerate(m["tool_calls"])]
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise OpenAIError(f"messages[{i}] is a tool message without a tool_call_id; give the id of the call "
                              "it answers", param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _call(i: int, k: int, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(f"messages[{i}].tool_calls[{k}] is {call!r}; give {{id, type: function, function: "
                          "{name, arguments}}}", param=f"messages[{i}].tool_calls")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def same(a: dict, b: dict) -> bool:
    """Whether two canonical messages say the same (content None and "" alike; arguments as JSON)."""
    if (a["role"], a["content"] or "", a.get("tool_call_id"), a.get("name")) != \
            (b["role"], b["content"] or "", b.get("tool_call_id"), b.get("name")):
        return False
    calls_a, calls_b = a.get("tool_calls") or [], b.get("tool_calls") or []
    return len(calls_a) == len(calls_b) and all(
        (x["id"], x["function"]["name"], _json(x["function"]["arguments"])) ==
        (y["id"], y["function"]["name"], _json(y["function"]["arguments"])) for x, y in zip(calls_a, calls_b))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def for_template(m: dict) -> dict:
    """A canonical message as chat templates take it (module docstring)."""
    out = dict(m, content=m["content"] or "")
    if m.get("tool_calls"):
        out["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_json(c["function"]["arguments"])))
                             for c in m["tool_calls"]]
    return out


def answer_message(content: Optional[str], calls: list[tuple[str, str, str]]) -> dict:
    """The assistant's canonical message: its content and its calls as (id, name, arguments)."""
    out = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                             for i, n, a in calls]
    return out


def logprobs_content(tokens: list[str], logprobs: list[float], top: int) -> dict:
    """OpenAI's `logprobs` of an answer: each token's text and log-prob; `top_logprobs` hold the
    chosen token alone (the engine reports no alternatives)."""
    def entry(token: str, lp: float) -> dict:
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}
    return {"content": [dict(entry(t, lp), top_logprobs=[entry(t, lp)] if top else [])
                        for t, lp in zip(tokens, logprobs)], "refusal": None}


def completion(cid: str, model: str, msg: dict, finish: str, usage: dict, logprobs: Optional[dict]) -> dict:
    """The `chat.completion` object of one answer."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage}


def models(name: str) -> dict:
    """The `GET /v1/models` answer: the one model served (the run's policy)."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "xray"}]}
