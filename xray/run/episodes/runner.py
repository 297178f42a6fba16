"""Multi-turn episodes on a rollout engine: many in flight, the engine's turns batched while others wait.

`EpisodeRunner.run(rows)` plays one episode per row against an environment (`xray/env/base.py`,
each call guarded by a timeout) and returns token-exact trajectories (`xray/data/trajectory.py`):
- every trajectory ready for a model turn joins the next `generate` call on the rollout WholeModel
  (one call for all of them: the engine batches them, and its prefix cache serves the history a
  turn shares with the one before);
- the turn's tokens and log-probs are appended as the engine produced them, its text (decoded
  once) goes to the environment's `step`, as a task of its own: while one episode waits on its
  tool or judge, the engine generates for the others;
- the observation is appended (never trained on): without a chat template (`chat`: the run's
  `data.chat_template` settings; a tokenizer without one, as the built-in character model's), its
  text tokenized alone, or its ids as given; the episode ends when the environment says done, at a
  limit (`TrajectoryLimits`), or on the environment's failure (`EpisodeEnd`: recorded, counted,
  never the run's end).

`rollout` is a WholeModel, or anything with its `generate` (an asynchronous run's maker batches the
turns of its episodes across runs and reports the weight version of each call,
`xray/run/detached/episode_maker.py`). A turn stops at the engine's stop tokens (the tokenizer's
end-of-sequence: pass them in `sampling["stop_token_ids"]`), and at the first of the environment's
`stop` strings (a tool call's closing tag, say): they go to the engine with the turn
(`sampling["stop"]`, beside any of the rollout's own; the engine must be built with `stop_strings`,
as a run builds it when `env.name` is set), so that it stops there instead of running on to
`max_turn_tokens`, and the runner cuts each turn at the same place whatever the engine did (`cut`):
the turn keeps its tokens up to the one that completes the stop (those after it are dropped, with
their log-probs; sampling is causal, so the kept ones are exactly what the engine sampled).
`engine_stops=False` keeps the strings off the engine (one built without `stop_strings`): the cut
alone then ends the turn.

With a chat template, the episode is the model's chat format, rendered as the agent endpoint renders
an agent's messages (`xray/data/chat_delta.py`, one path for both): the prompt is the row's
(`prompt_ids`, rendered by the template), or, for an environment with tools (`tool_schemas`), its
messages rendered with the tools' schemas (`apply_chat_template(tools=...)`; a template that does
not render `tools` is refused with the fix); after a turn, the observation adds what the template
writes after that answer: the end of the assistant's turn (`<|im_end|>\n` on ChatML, after a turn
cut at a stop string too; the end-of-turn token the engine produced itself, when the turn stopped on
it, is not written again), the observation's messages (a `ChatObservation`'s, a tool's answers as
`role: tool`; text as one user message) and the generation prompt. Ids are appended as given.

`run(rows, ended)` calls `ended(i, trajectory)` as each episode ends, while the others go on (an
asynchronous maker puts a prompt's group as soon as its episodes have ended).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from xray.data.chat import ChatFormat, PromptRenderer
from xray.data.chat_delta import ChatRenderer, Conversation
from xray.data.stops import stop_string_end
from xray.data.trajectory import Trajectory, TrajectoryLimits
from xray.env.base import EnvError, EpisodeEnd, Guarded


class EpisodeRunner:
    """Plays episodes of one environment class on one rollout model (see the module docstring)."""

    def __init__(self, rollout: Any, tokenizer: Any, make_env: Callable[[], Any], limits: TrajectoryLimits,
                 sampling: dict, env_timeout_s: float = 30.0, engine_stops: bool = True,
                 chat: ChatFormat = ChatFormat()):
        self.rollout, self.tokenizer, self.make_env = rollout, tokenizer, make_env
        self.limits, self.sampling, self.env_timeout_s = limits, dict(sampling), env_timeout_s
        self.engine_stops = engine_stops
        template = chat.template_text(tokenizer)
        self.chat = None if template is None else ChatRenderer(tokenizer, template, chat.kwargs)
        """The chat template's renderer (None: plain text, module docstring)."""
        self.prompts = None if template is None else PromptRenderer(tokenizer, chat)
        self.calls = 0
        self.stats: collections.Counter = collections.Counter()
        """Counts over the runs: `turns`, `generate_calls`, `ends/<reason>`, `env_wait_s`."""

    def ids(self, observation: Any) -> list[int]:
        """An observation's token ids: text tokenized alone (no special tokens added), ids as given."""
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False).input_ids) if observation else []
        return [int(t) for t in observation]

    async def run(self, rows: list[dict], ended: Callable[[int, Trajectory], None] | None = None) -> list[Trajectory]:
        """One trajectory per row, in order; `ended(i, trajectory)` as each ends (module docstring)."""
        ended = ended or (lambda i, t: None)
        envs = [Guarded(self.make_env(), self.env_timeout_s) for _ in rows]
        firsts = await asyncio.gather(*[env.reset(row) for env, row in zip(envs, rows)])
        trajectories, ready = [], []
        chats: list[Conversation | None] = [None] * len(rows)  # with a chat template: each episode's
        for i, (row, first) in enumerate(zip(rows, firsts)):
            if isinstance(first, EpisodeEnd):
                t = Trajectory(prompt_ids=list(row.get("prompt_ids") or []))
                self._finish(t, first.reason, first.detail)
                ended(i, t)
            else:
                prompt, chats[i] = self._prompt(row, first, envs[i].env)
                t = Trajectory(prompt_ids=prompt)
                ready.append(i)
            trajectories.append(t)
        waiting: dict[asyncio.Future, tuple[int, float]] = {}
        while ready or waiting:
            if ready:
                batch, ready = ready, []
                await self._turn([trajectories[i] for i in batch], batch, envs, waiting, chats)
            if not waiting:
                continue
            done, _ = await asyncio.wait(list(waiting), timeout=0 if ready else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, started = waiting.pop(task)
                self.stats["env_wait_s"] += time.perf_counter() - started
                if self._observe(trajectories[i], task.result(), chats[i]):
                    ready.append(i)
                else:
                    ended(i, trajectories[i])
        return trajectories

    async def _turn(self, batch: list[Trajectory], indices: list[int], envs: list[Guarded],
                    waiting: dict[asyncio.Future, tuple[int, float]], chats: list[Conversation | None]) -> None:
        """One model turn for each trajectory of `batch` (one engine call); each turn's text goes to
        its environment's `step`, as a task, and its conversation (`chats`, by episode)."""
        from xray.backends.sampling import RESPONSE_LOGPROBS, WEIGHT_VERSION
        from xray.data import columns as C

        rooms = [t.room(self.limits) for t in batch]
        self.calls += 1
        sampling = dict(self.sampling, n=1, max_new_tokens=max(rooms),
                        seed=self.sampling.get("seed", 0) * 1_000_003 + self.calls)
        stops = {tuple(getattr(envs[i].env, "stop", ()) or ()) for i in indices}
        if self.engine_stops and len(stops) == 1 and next(iter(stops)):  # one call, one stop list
            sampling["stop"] = list(dict.fromkeys([*(sampling.get("stop") or ()), *next(iter(stops))]))
        prompts = [t.ids for t in batch]
        dp = getattr(getattr(self.rollout, "parallel", None), "dp", 1)  # every replica takes an equal part:
        prompts += [prompts[0]] * (-len(prompts) % dp)  # copies of the first fill the last (answers dropped)
        out = await self.rollout.generate(prompts, sampling)
        version = int(out.get(WEIGHT_VERSION, 0)) if isinstance(out, dict) else 0
        per_token = out.get(C.BEHAVIOUR_VERSIONS) if isinstance(out, dict) else None  # a turn in segments
        self.stats["generate_calls"] += 1
        for k, (t, i, room, ids, logprobs) in enumerate(zip(batch, indices, rooms, out[C.RESPONSE_IDS],
                                                          out[RESPONSE_LOGPROBS])):
            keep = self.cut(ids[:room], getattr(envs[i].env, "stop", ()))
            ids, logprobs = [int(x) for x in ids[:keep]], [float(x) for x in logprobs[:keep]]
            t.add_turn(ids, logprobs, version if per_token is None else per_token[k][:keep])
            self.stats["turns"] += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if chats[i] is not None:
                end = self.chat.turn_end(ids, self.sampling.get("stop_token_ids"))
                chats[i].answered({"role": "assistant", "content": text}, end)
            waiting[asyncio.ensure_future(envs[i].step(text))] = (i, time.perf_counter())

    def cut(self, ids: list[int], stops) -> int:
        """How many of a turn's tokens it keeps: up to the token that completes the first of the
        `stops` strings in its text (`xray.data.stops.stop_string_end`, the rollout engines' rule);
        all of them when none occurs."""
        end = stop_string_end(lambda part: self.tokenizer.decode(part, skip_special_tokens=True), ids, stops or ())
        return len(ids) if end is None else end

    def _observe(self, t: Trajectory, result: Any, chat: Conversation | None) -> bool:
        """The environment's answer to the last turn (`chat`: the episode's conversation, with a chat
        template); whether the episode goes on."""
        if isinstance(result, EpisodeEnd):
            self._finish(t, result.reason, result.detail)
            return False
        observation, reward, done, info = result
        t.rewards.append(float(reward))
        t.info = dict(info or {})
        if done:
            self._finish(t, "done")
            return False
        ids = self._observation_ids(observation, chat)
        if len(t.tokens) + len(ids) >= self.limits.max_tokens:
            self._finish(t, "max_tokens")
            return False
        t.add_observation(ids)
        if t.room(self.limits) == 0:
            self._finish(t, "max_turns" if len(t.turns) >= self.limits.max_turns else "max_tokens")
            return False
        return True

    def _prompt(self, row: dict, first: Any, env: Any) -> tuple[list[int], Conversation | None]:
        """The prompt's ids: the row's `prompt_ids`, else the first observation's; with a chat template
        and an environment with tools, the first observation's messages rendered with the tools'
        schemas. With a chat template, the episode's conversation too (None without)."""
        if self.chat is None:
            return list(row.get("prompt_ids") or self.ids(first)), None
        tools = list(getattr(env, "tool_schemas", None) or []) or None
        if tools and not self.chat.renders_tools:
            raise EnvError("the environment has tools but the run's chat template does not render `tools` (the "
                           "model would never see their schemas); set data.chat_template to a template that does, "
                           "e.g. configs/chat_templates/chatml_tools.jinja for a ChatML model, or to none (plain text)")
        given = getattr(first, "messages", first)
        if isinstance(given, (list, tuple)) and given and not isinstance(given[0], dict):  # ids: as given
            ids = [int(x) for x in row.get("prompt_ids") or given]
            user = {"role": "user", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
            return ids, Conversation(self.chat, [user], tools)
        messages = self.prompts.messages(list(given) if isinstance(given, tuple) else given)
        conversation = Conversation(self.chat, messages, tools)
        if row.get("prompt_ids") and not tools:  # rendered by the same template already (`xray/data/prompts.py`)
            return list(row["prompt_ids"]), conversation
        return conversation.prompt_ids(), conversation

    def _observation_ids(self, observation: Any, conversation: Conversation | None) -> list[int]:
        """An observation's ids: plain (`ids`) without a chat template, or ids; with one, the closing
        of the model's turn, the observation's messages (text: one user message) and the generation
        prompt, as the template renders them (`Conversation.observe`)."""
        if conversation is None or not isinstance(observation, str):
            return self.ids(observation)
        messages = getattr(observation, "messages", None)
        if messages is None:
            messages = [{"role": "user", "content": str(observation)}] if observation else []
        return conversation.observe([dict(m) for m in messages])

    def _finish(self, t: Trajectory, end: str, detail: str = "") -> None:
        t.finish(end, detail)
        self.stats[f"ends/{end}"] += 1
