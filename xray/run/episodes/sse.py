"""A chat completion as OpenAI's stream: `chat.completion.chunk` objects sent as server-sent events.

Sits beside the OpenAI-compatible endpoint (`xray/run/episodes/endpoint.py`), which answers a
`stream: true` request with these once its answer is generated (the engine generates a turn in one
call, with the other sessions' turns: the answer is streamed whole, not token by token). The chunks
are those an `openai` client assembles (`client.chat.completions.stream`, or by hand): the role
(content "" or, for calls alone, null); the content, with its logprobs; each tool call as one chunk
with its index, id, type, name and empty arguments, then one with its arguments; the finish reason;
with `stream_options.include_usage`, the usage in a last chunk without choices. Each is one
`data: {json}\n\n` event, and `data: [DONE]\n\n` ends the stream.
"""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"


def event(chunk: dict) -> bytes:
    """One server-sent event holding `chunk`."""
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n\n"


def chunks(completion: dict, include_usage: bool = False) -> list[dict]:
    """The `chat.completion.chunk` objects of a `chat.completion` (module docstring)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")}

    def chunk(delta: dict, finish=None, logprobs=None) -> dict:
        return dict(head, object="chat.completion.chunk",
                    choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

    out = [chunk({"role": "assistant", "content": "" if msg.get("content") else None})]  # None: calls only
    if msg.get("content") or choice.get("logprobs"):
        out.append(chunk({"content": msg.get("content") or ""}, logprobs=choice.get("logprobs")))
    for index, call in enumerate(msg.get("tool_calls") or []):
        fn = call["function"]
        out.append(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))
        out.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}))
    out.append(chunk({}, finish=choice["finish_reason"]))
    if include_usage:
        out.append(dict(head, object="chat.completion.chunk", choices=[], usage=completion["usage"]))
    return out


def stream_body(completion: dict, include_usage: bool = False) -> bytes:
    """The whole event stream of `completion`, `[DONE]` last."""
    return b"".join(event(c) for c in chunks(completion, include_usage)) + DONE
