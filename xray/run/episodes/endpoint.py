"""An OpenAI-compatible chat-completions endpoint on the rollout engine, for agent code xray did not write.

Sits in the run machinery beside the episode runner (`xray/run/episodes/runner.py`): where the runner
drives an environment, here the user's agent drives, through the `openai` client, unchanged. Each
episode is a session with its own base URL (`http://HOST:PORT/sessions/<id>/v1`); the agent posts
`chat/completions` to it as to any server (function calling, streaming, stop strings, log-probs;
the wire format: `xray/run/episodes/openai_messages.py`, `sse.py`), and the session records a
token-exact trajectory (`xray/data/trajectory.py`):

- the first request's messages and tools, rendered by the run's chat template (`data.chat_template`
  with its kwargs; their contents joined where none is in use) with the generation prompt, are the
  prompt's ids;
- each answer is the engine's own tokens and log-probs, appended as produced (model tokens), and
  returned as the message: its text, with the tool calls the run's parser (`env.tool_parser`,
  `xray/run/episodes/tool_calls.py`) finds taken out as OpenAI `tool_calls` (finish reason
  `tool_calls`); a request's `stop` strings cut the turn after the token that completes one;
- a later request must repeat the conversation as returned, with the same tools (else 400:
  nothing is re-tokenized, so a rewritten history cannot be trained on exactly); what it adds
  (`role: tool` results, user turns) is rendered by the template after the last answer
  (`xray/data/chat_delta.py`, as the episode runner renders an environment's turns: the rest of
  that turn's markup, the new messages, the generation prompt) and appended as an observation (mask 0).
The engine is fed the trajectory's ids, never a re-rendered history. A session serves its
requests one at a time, in order; a request whose client went away is dropped (nothing of it is
recorded) without holding up the others of its generate call. Requests of all sessions that
arrive within `window_s` of each other go to the engine in one `generate` call (padded to a
multiple of its replicas). Sampling is the run's (`sampling`): a request's own temperature or top_p
are ignored, so the trajectories are the policy's samples; its `max_tokens` is honoured within the
limits (`TrajectoryLimits`). Errors come in OpenAI's shape with a 4xx status. Served with aiohttp on
the driver's event loop; `GET .../v1/models` lists the one model (`model`).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from xray.data.chat import ChatFormat, ChatTemplateError
from xray.data.chat_delta import ChatRenderer
from xray.data.stops import stop_string_end
from xray.data.trajectory import Trajectory, TrajectoryLimits
from xray.run.episodes import sse
from xray.run.episodes.openai_messages import (ChatRequest, OpenAIError, answer_message, completion, for_template,
                                               logprobs_content, models, same)
from xray.run.episodes.tool_calls import tool_parser

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One episode's conversation: the messages accounted for and the trajectory."""

    trajectory: Trajectory | None = None
    messages: list = field(default_factory=list)
    """The conversation as the trajectory holds it, canonical (the last entry: the last answer)."""
    tools: Optional[list] = None
    """The tools of its first request (later ones must give the same)."""
    answer_end: str = ""
    """The text of the last answer's end-of-turn token (empty: it ended otherwise)."""
    requests: int = 0
    limit: str = ""
    """`max_turns` or `max_tokens` once a request was refused at that limit: the episode is over."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while one of its requests is served: a session's requests run in order."""


class AgentEndpoint:
    """Serves `POST /sessions/<id>/v1/chat/completions` from `rollout` (see the module docstring)."""

    def __init__(self, rollout: Any, tokenizer: Any, limits: TrajectoryLimits, sampling: dict,
                 host: str = "127.0.0.1", port: int = 0, window_s: float = 0.005, chat: ChatFormat = ChatFormat(),
                 tool_parser_name: str = "hermes", model: str = "policy"):
        self.rollout, self.tokenizer, self.limits = rollout, tokenizer, limits
        self.renderer = ChatRenderer(tokenizer, chat.template_text(tokenizer), chat.kwargs)
        self.parser, self.model = tool_parser(tool_parser_name), model
        self.sampling, self.host, self.port, self.window_s = dict(sampling), host, port, window_s
        self.sessions: dict[str, Session] = {}
        self.serial = itertools.count(1)
        self.queue: list[tuple[list[int], int, asyncio.Future]] = []
        self.flushing: asyncio.Task | None = None
        self.runner = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop serving (a server lives and dies with its loop)."""
        self.calls = 0
        """Generate calls made (each serves every request then waiting)."""

    # -- the server ------------------------------------------------------------------------------
    async def start(self) -> str:
        """Serve on `host:port` (port 0: a free one); the address `http://host:port`."""
        from aiohttp import web

        self.loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._handle)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        self.flushing, self.queue = None, []
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("agent endpoint serving on http://%s:%d", self.host, self.port)
        return self.address

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def open(self) -> tuple[str, str]:
        """A new session: (its id, the base URL an `openai` client takes)."""
        sid = f"ep{next(self.serial)}"
        self.sessions[sid] = Session()
        return sid, f"{self.address}/sessions/{sid}/v1"

    def close(self, sid: str) -> tuple[Trajectory, str]:
        """The session's trajectory (empty when the agent never asked) and the limit that ended
        it (`Session.limit`, empty if none); the session forgotten."""
        session = self.sessions.pop(sid)
        return (session.trajectory if session.trajectory is not None else Trajectory(prompt_ids=[])), session.limit

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(models(self.model))

    async def _handle(self, request):
        from aiohttp import web

        sid = request.match_info["sid"]
        try:
            session = self.sessions.get(sid)
            if session is None:
                raise OpenAIError(f"unknown session {sid!r}: open one per episode (AgentEndpoint.open) and use its "
                                  "base URL", code="session_not_found", status=404)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise OpenAIError("the request body is not JSON; send a chat.completions JSON object",
                                  code="invalid_json") from None
            req = ChatRequest.of(body)
            answer = await self.complete(session, req, sid)
        except OpenAIError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except Exception as exc:  # noqa: BLE001 - the engine failed: the agent gets OpenAI's 500
            log.exception("agent endpoint: a request of session %s failed", sid)
            error = OpenAIError(f"the rollout engine failed: {type(exc).__name__}: {exc}", code="engine_error",
                                status=500, kind="server_error")
            return web.json_response(error.body(), status=500)
        if not req.stream:
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(sse.stream_body(answer, req.include_usage))
        await response.write_eof()
        return response

    # -- one request -----------------------------------------------------------------------------
    async def complete(self, session: Session, req: ChatRequest, sid: str = "ep") -> dict:
        """Serve one request of `session` after those before it: its `chat.completion` object."""
        async with session.lock:
            return await self._complete(session, req, sid)

    async def _complete(self, session: Session, req: ChatRequest, sid: str) -> dict:
        prompt, observation = self._account(session, req)
        t = session.trajectory or Trajectory(prompt_ids=prompt)
        room = self._room(t, len(observation))
        if room <= 0:
            session.limit = "max_turns" if len(t.turns) >= self.limits.max_turns else "max_tokens"
            raise OpenAIError(f"the episode is at its limit ({session.limit}: {self.limits}); end it",
                              code="episode_limit")
        ids, logprobs, reason = await self._submit(t.ids + observation, min(room, req.max_tokens or room))
        ids, logprobs, cut = self._cut(ids, logprobs, req.stop)
        # served: recorded now, all at once (a cancelled request leaves the session as it was)
        if session.trajectory is None:
            session.trajectory, session.tools = t, req.tools
        else:
            t.add_observation(observation)
        t.add_turn(ids, logprobs)
        session.requests += 1
        msg, finish = self._message(sid, session.requests, ids, req, "stop" if cut or reason == "stop" else "length")
        session.messages = req.messages + [msg]
        session.answer_end = self.renderer.turn_end(ids, self.sampling.get("stop_token_ids")) \
            if reason == "stop" and not cut else ""
        used = len(ids)
        usage = {"prompt_tokens": len(t.ids) - used, "completion_tokens": used, "total_tokens": len(t.ids)}
        lps = logprobs_content([self.tokenizer.decode([i]) for i in ids], logprobs, req.top_logprobs) \
            if req.logprobs else None
        return completion(f"chatcmpl-{sid}-{session.requests}", req.model, msg, finish, usage, lps)

    def check_tools(self, tools: Optional[list]) -> None:
        """Refuse tools the run's chat template would drop without a word."""
        if tools and not self.renderer.renders_tools:
            raise OpenAIError("the request gives tools but the run's chat template does not render them (the model "
                              "would never see their schemas); set data.chat_template to a template that renders "
                              "`tools`, e.g. configs/chat_templates/chatml_tools.jinja for a ChatML model",
                              param="tools", code="tools_not_rendered")

    def _account(self, session: Session, req: ChatRequest) -> tuple[list[int], list[int]]:
        """(the prompt's ids, the new messages' ids): the first request's messages as the prompt; a
        later one's beyond the conversation so far as an observation. Records nothing."""
        self.check_tools(req.tools)
        try:
            return self._render(session, req)
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), param="messages", code="template_error") from None

    def _render(self, session: Session, req: ChatRequest) -> tuple[list[int], list[int]]:
        if session.trajectory is None:
            return self.renderer.prompt_ids([for_template(m) for m in req.messages], req.tools,
                                            req.template_kwargs), []
        known, messages = session.messages, req.messages
        if len(messages) < len(known) or not all(same(a, b) for a, b in zip(messages, known)):
            raise OpenAIError("the messages do not repeat this session's conversation as the endpoint returned it; "
                              "send the history unchanged (training needs the exact tokens the model produced) "
                              "and only add new messages after it", param="messages", code="history_changed")
        if len(messages) == len(known):
            raise OpenAIError("no new message after the last answer; add the tool's or the user's reply",
                              param="messages", code="no_new_message")
        if req.tools != session.tools:
            raise OpenAIError("the tools differ from this session's first request's; the prompt the model saw holds "
                              "those: send the same tools in every request of a session", param="tools")
        new = [for_template(m) for m in messages[len(known):]]
        ids = self.renderer.delta_ids([for_template(m) for m in known], new, session.answer_end, req.tools,
                                      req.template_kwargs)
        if len(session.trajectory.tokens) + len(ids) >= self.limits.max_tokens:
            session.limit = "max_tokens"
            raise OpenAIError(f"the new messages take the episode past max_tokens={self.limits.max_tokens}; end it",
                              code="episode_limit")
        return session.trajectory.prompt_ids, ids

    def _room(self, t: Trajectory, adding: int) -> int:
        """Tokens the next turn may generate once `adding` observation tokens follow `t`."""
        if len(t.turns) >= self.limits.max_turns:
            return 0
        return max(0, min(self.limits.max_turn_tokens, self.limits.max_tokens - len(t.tokens) - adding))

    def _cut(self, ids: list[int], logprobs: list[float], stops: tuple[str, ...]):
        """The turn up to the token that completes the first stop string (`xray.data.stops`);
        (ids, log-probs, whether one was found)."""
        end = stop_string_end(lambda part: self.tokenizer.decode(part, skip_special_tokens=True), ids, stops)
        return (ids, logprobs, False) if end is None else (ids[:end], logprobs[:end], True)

    def _message(self, sid: str, serial: int, ids: list[int], req: ChatRequest, finish: str) -> tuple[dict, str]:
        """The answer as OpenAI's assistant message (canonical) and its finish reason."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        found = [text.index(s) for s in req.stop if s in text]
        if found:  # OpenAI's answers leave the stop string out (the trajectory keeps its tokens)
            text = text[:min(found)]
        if not req.parses_tools:
            return answer_message(text, []), finish
        parsed = self.parser.parse(text)
        calls = [(f"call_{sid}_{serial}_{k}", c.name, c.arguments) for k, c in enumerate(parsed.calls)]
        return answer_message(parsed.content, calls), "tool_calls" if calls else finish

    # -- the engine ------------------------------------------------------------------------------
    async def _submit(self, prompt: list[int], room: int) -> tuple[list[int], list[float], str]:
        """The engine's answer to `prompt`, in the next generate call."""
        future = asyncio.get_running_loop().create_future()
        self.queue.append((prompt, room, future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        """The requests waiting after `window_s`, in one generate call; then those that came
        meanwhile, in the next."""
        while self.queue:
            await asyncio.sleep(self.window_s)
            batch, self.queue = [r for r in self.queue if not r[2].done()], []
            if batch:
                await self._generate(batch)

    async def _generate(self, batch: list[tuple[list[int], int, asyncio.Future]]) -> None:
        from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS
        from xray.data import columns as C

        try:
            prompts = [ids for ids, _, _ in batch]
            dp = getattr(getattr(self.rollout, "parallel", None), "dp", 1)
            prompts += [prompts[0]] * (-len(prompts) % dp)
            self.calls += 1
            sampling = dict(self.sampling, n=1, max_new_tokens=max(room for _, room, _ in batch),
                            seed=self.sampling.get("seed", 0) * 1_000_003 + self.calls)
            out = await self.rollout.generate(prompts, sampling)
        except Exception as exc:  # noqa: BLE001 - every waiting request fails with it
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, room, future), ids, lps, reason in zip(batch, out[C.RESPONSE_IDS], out[RESPONSE_LOGPROBS],
                                                        out[FINISH_REASON]):
            if future.done():  # its client went away: the answer is dropped, the others served
                continue
            cut = min(room, len(ids))
            future.set_result(([int(x) for x in ids[:cut]], [float(x) for x in lps[:cut]],
                               reason if cut == len(ids) else "length"))
