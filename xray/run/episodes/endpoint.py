"""An OpenAI-compatible chat-completions endpoint on the rollout engine, for agent code xray did not write.

Sits in the run machinery beside the episode runner (`xray/run/episodes/runner.py`): where the runner
drives an environment, here the user's agent drives, through the `openai` client, unchanged. Each
episode is a session with its own base URL (`http://HOST:PORT/sessions/<id>/v1`); the agent posts
`chat/completions` to it as to any server, and the session records a token-exact trajectory
(`xray/data/trajectory.py`):

- the first request's messages, rendered (the run's chat template, `data.chat_template` with its
  kwargs, or their contents joined where none is in use) with the generation prompt, are the
  prompt's ids;
- each answer is the engine's own tokens and log-probs, appended as produced (model tokens), and
  returned as the message's text;
- a later request must repeat the conversation as returned (else 400: nothing is re-tokenized,
  so a rewritten history cannot be trained on exactly); what it adds (tool results, user turns)
  is rendered, and the text after the rendered history so far is tokenized alone and appended as
  an observation (mask 0).
The engine is fed the trajectory's ids, never a re-rendered history. Requests of all sessions that
arrive within `window_s` of each other go to the engine in one `generate` call (padded to a
multiple of its replicas). Sampling is the run's (`sampling`): a request's own temperature or top_p
are ignored, so the trajectories are the policy's samples; its `max_tokens` is honoured within the
limits (`TrajectoryLimits`). Served with aiohttp on the driver's event loop.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from xray.data.chat import ChatFormat
from xray.data.trajectory import Trajectory, TrajectoryLimits

log = logging.getLogger(__name__)


class EndpointError(ValueError):
    """A request the endpoint cannot serve exactly; its message is the HTTP 400's."""


@dataclass
class Session:
    """One episode's conversation: the messages accounted for and the trajectory."""

    trajectory: Trajectory | None = None
    messages: list = field(default_factory=list)
    """The conversation as the trajectory holds it (the last entry: the last answer)."""
    requests: int = 0
    limit: str = ""
    """`max_turns` or `max_tokens` once a request was refused at that limit: the episode is over."""


class AgentEndpoint:
    """Serves `POST /sessions/<id>/v1/chat/completions` from `rollout` (see the module docstring)."""

    def __init__(self, rollout: Any, tokenizer: Any, limits: TrajectoryLimits, sampling: dict,
                 host: str = "127.0.0.1", port: int = 0, window_s: float = 0.005, chat: ChatFormat = ChatFormat()):
        self.rollout, self.tokenizer, self.limits = rollout, tokenizer, limits
        self.template, self.template_kwargs = chat.template_text(tokenizer), dict(chat.kwargs)
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
        self.runner = web.AppRunner(app, access_log=None)
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

    async def _handle(self, request):
        from aiohttp import web

        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return web.json_response({"error": {"message": "unknown session: open one per episode "
                                                           "(AgentEndpoint.open)", "type": "not_found"}}, status=404)
        try:
            body = await request.json()
            text, reason = await self.complete(session, body)
        except EndpointError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
        t = session.trajectory
        used = t.turns[-1][1] - t.turns[-1][0]
        return web.json_response({
            "id": f"chatcmpl-{request.match_info['sid']}-{session.requests}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", "xray"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}],
            "usage": {"prompt_tokens": len(t.ids) - used, "completion_tokens": used, "total_tokens": len(t.ids)}})

    # -- one request -----------------------------------------------------------------------------
    async def complete(self, session: Session, body: dict) -> tuple[str, str]:
        """Account the request's messages, generate the answer; (its text, finish reason)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError("'messages' must be a non-empty list of {role, content} objects")
        messages = [{"role": m.get("role"), "content": m.get("content") or ""} for m in messages]
        if body.get("n", 1) != 1:
            raise EndpointError("n must be 1: each sample is its own session")
        self._account(session, messages)
        t = session.trajectory
        room = t.room(self.limits)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or room
        if room <= 0:
            session.limit = "max_turns" if len(t.turns) >= self.limits.max_turns else "max_tokens"
            raise EndpointError(f"the episode is at its limit ({session.limit}: {self.limits}); end it")
        future = asyncio.get_running_loop().create_future()
        self.queue.append((t.ids, min(room, int(asked)), future))
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.ensure_future(self._flush())
        ids, logprobs, reason = await future
        t.add_turn(ids, logprobs)
        session.requests += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        session.messages = messages + [{"role": "assistant", "content": text}]
        return text, "stop" if reason == "stop" else "length"

    def _account(self, session: Session, messages: list[dict]) -> None:
        """The request's messages into the trajectory: the first request's as the prompt; a later
        one's beyond the conversation so far as an observation, tokenized alone."""
        if session.trajectory is None:
            session.trajectory = Trajectory(prompt_ids=self._ids(self._render(messages, True)))
            return
        known = session.messages
        if messages[:len(known)] != known:
            raise EndpointError("the messages do not repeat this session's conversation as the endpoint returned it; "
                                "send the history unchanged (training needs the exact tokens the model produced) "
                                "and only add new messages after it")
        if len(messages) == len(known):
            raise EndpointError("no new message after the last answer; add the tool's or the user's reply")
        before, now = self._render(known, False), self._render(messages, True)
        if not now.startswith(before):
            raise EndpointError("the chat template renders the conversation so far otherwise once new messages "
                                "follow it; token-exact training cannot use this template")
        ids = self._ids(now[len(before):])
        t = session.trajectory
        if len(t.tokens) + len(ids) >= self.limits.max_tokens:
            session.limit = "max_tokens"
            raise EndpointError(f"the new messages take the episode past max_tokens={self.limits.max_tokens}; end it")
        t.add_observation(ids)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.template:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **self.template_kwargs)
        return "".join(m["content"] for m in messages)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    async def _flush(self) -> None:
        """The requests waiting after `window_s`, in one generate call; then those that came
        meanwhile, in the next."""
        while self.queue:
            await asyncio.sleep(self.window_s)
            batch, self.queue = self.queue, []
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
                future.set_exception(exc)
            return
        for (_, room, future), ids, lps, reason in zip(batch, out[C.RESPONSE_IDS], out[RESPONSE_LOGPROBS],
                                                        out[FINISH_REASON]):
            cut = min(room, len(ids))
            future.set_result(([int(x) for x in ids[:cut]], [float(x) for x in lps[:cut]],
                               reason if cut == len(ids) else "length"))
