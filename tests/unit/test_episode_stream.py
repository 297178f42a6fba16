"""An asynchronous maker's episodes stream (`xray/run/detached/episode_maker.py`), without Ray: a
prompt's group goes into the buffer as soon as its episodes end, while a slow episode of the same
lease is still waiting on its tool, and the freed slot is leased again at once; a turn is
generated `async.segment_tokens` at a time, each token with the weight version that sampled it,
ending at the environment's stop string, which the engine is given. A synchronous agent's timeout
(`xray/run/episodes/agent_threads.py`) counts only its running time when many agents queue."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from xray.backends.sampling import FINISH_REASON, RESPONSE_LOGPROBS
from xray.config.data import DataConfig
from xray.config.env import EnvConfig
from xray.data import columns as C
from xray.data.stops import stop_string_end
from xray.data.tokenizer import EOS_ID, build_char_tokenizer

pytestmark = pytest.mark.unit
TOK = build_char_tokenizer()


class Script:
    """A rollout replica that writes `text` then end-of-sequence after any prompt (continuing a
    prompt that already holds part of it), stopping at `sampling["stop"]` strings as vLLM does;
    it records each call's sampling, and `on_call` runs after each call (a weight load)."""

    parallel = SimpleNamespace(dp=1)

    def __init__(self, text: str, base: int, on_call=lambda: None):
        self.ids, self.base, self.on_call, self.calls = TOK(text, add_special_tokens=False).input_ids + [EOS_ID], base, on_call, []

    async def generate(self, prompts, sampling):
        self.calls.append(dict(sampling, prompts=len(prompts)))
        await asyncio.sleep(0.002)
        out = {C.RESPONSE_IDS: [], RESPONSE_LOGPROBS: [], FINISH_REASON: []}
        for p in prompts:
            ids = self.ids[len(p) - self.base:][:sampling["max_new_tokens"]]
            end = stop_string_end(lambda part: TOK.decode(part, skip_special_tokens=True), ids, sampling.get("stop") or ())
            ids = ids if end is None else ids[:end]
            out[C.RESPONSE_IDS].append(ids)
            out[RESPONSE_LOGPROBS].append([-0.5] * len(ids))
            out[FINISH_REASON].append("stop" if end is not None or ids[-1:] == [EOS_ID] else "length")
        self.on_call()
        return out


class Tool:
    """One turn, then the tool answers after the row's `delay` seconds and the episode is done;
    its turns stop at `</t>`. Keeps when each episode's tool answered (`ENDED`, by prompt)."""

    stop = ("</t>",)
    ENDED: dict = {}

    async def reset(self, row):
        self.row = row
        return row["prompt"]

    async def step(self, action):
        await asyncio.sleep(self.row["delay"])
        Tool.ENDED.setdefault(self.row["prompt"], []).append(time.perf_counter())
        return "", float(action.startswith("ab")), True, {}


def maker(engine, segment_tokens: int = 0, max_in_flight: int = 2, n_samples: int = 2, buffer=None):
    """A real `ExperienceMaker` (not a Ray actor) with its episode loop, over `engine`; its puts
    are recorded (time, lease keys) instead of going to the object store."""
    from xray.run.detached.episode_maker import EpisodeMaking
    from xray.run.detached.maker import ExperienceMaker

    rollout = SimpleNamespace(max_new_tokens=8, n_samples=n_samples, temperature=1.0, top_p=1.0, top_k=-1, stop=())
    cfg = SimpleNamespace(async_=SimpleNamespace(segment_tokens=segment_tokens, max_in_flight=max_in_flight),
                          rollout=rollout, seed=0, data=DataConfig(),
                          env=EnvConfig(name="builtin:guess", max_turns=1, max_turn_tokens=8, max_tokens=16, timeout_s=5))
    m = ExperienceMaker(0, engine, None, None, buffer, cfg, [EOS_ID], 0, share=2, version=3, tokenizer=TOK)
    m.episodes = EpisodeMaking(m, TOK)
    m.episodes.runner.make_env = Tool
    m.puts, m.counts = [], []

    async def put(batch, ref, groups, scores, keep, which, counts=None):
        m.puts.append((time.perf_counter(), [g[0].key for g in groups], [s.versions for g in groups for s in g]))
        m.counts.extend(counts)
        m.in_flight -= len(groups)
        m._freed().set()
    m._put = put
    return m


def test_a_group_is_put_before_a_slow_episode_of_its_lease_ends_and_its_slot_is_leased_again():
    """Lease 1: prompt `a` (tool 10 ms) and prompt `b` (tool 1 s), 2 episodes each. `a`'s group is
    put ~1 s before `b`'s episodes end (the lease-wide wait put both together after `b`), and the
    slot it frees is leased again (`c`) while `b` still waits."""
    leases = []
    rows = [[(1, {"prompt": "a", "delay": 0.01}), (2, {"prompt": "b", "delay": 1.0})],
            [(3, {"prompt": "c", "delay": 0.01})]]

    async def lease(index, most, version, wait=True):
        if not rows:
            await asyncio.sleep(3600)  # no admission: the loop goes on with what it has
        leases.append((time.perf_counter(), most))
        return rows.pop(0)[:most]

    Tool.ENDED = {}
    m = maker(Script("ab", base=1), buffer=SimpleNamespace(lease=SimpleNamespace(remote=lease)))

    async def run():
        task = asyncio.ensure_future(m.episodes.loop())
        while len(m.puts) < 3 and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    (t_a, keys_a, _), (t_c, keys_c, _), (t_b, keys_b, _) = m.puts
    assert (keys_a, keys_c, keys_b) == ([1], [3], [2])
    b_ended = min(Tool.ENDED["b"])
    assert b_ended - t_a > 0.8, b_ended - t_a  # put ~1 s before the slow episode of its lease ends
    assert leases[1][1] == 1 and leases[1][0] < b_ended - 0.8  # its slot leased again meanwhile
    assert t_b >= max(Tool.ENDED["b"]) and m.in_flight == 0
    assert [c["episodes"] for c in m.counts] == [2, 2, 2]  # each group's counts go with it
    assert sum(c["ends_done"] for c in m.counts) == 6 and all(c["turns"] == 2 for c in m.counts), m.counts


def test_a_turn_is_generated_in_segments_with_each_tokens_version_and_stops_at_its_stop_string():
    """`async.segment_tokens=2`: the turn `ab</t>` takes 3 calls of at most 2 tokens, a weight load
    after each (version 3, 4, 5 per pair of tokens); the environment's stop string goes to the
    engine with every call; the turn ends at it though no call's engine saw it whole (`</` and
    `t>` came in two segments), before the tokens after it (`cd`) are generated."""
    engine = Script("ab</t>cd", base=1)
    m = maker(engine, segment_tokens=2, n_samples=1)
    engine.on_call = lambda: setattr(m, "version", m.version + 1)
    (t,) = asyncio.run(m.episodes.runner.run([{"prompt": "q", "delay": 0.0}]))
    assert TOK.decode(t.tokens) == "ab</t>" and t.end == "done" and t.rewards == [1.0]
    assert t.versions == [3, 3, 4, 4, 5, 5] and t.logprobs == [-0.5] * 6
    assert [(c["max_new_tokens"], c["stop"]) for c in engine.calls] == [(2, ["</t>"])] * 3

    whole = Script("ab</t>cd", base=1)  # segments off: one call, the engine stops at the string
    m = maker(whole, segment_tokens=0, n_samples=1)
    (t,) = asyncio.run(m.episodes.runner.run([{"prompt": "q", "delay": 0.0}]))
    assert TOK.decode(t.tokens) == "ab</t>" and t.versions == [3] * 6
    assert [(c["max_new_tokens"], c["stop"]) for c in whole.calls] == [(8, ["</t>"])]


def test_a_sync_agents_timeout_counts_its_running_time_not_its_wait_for_a_thread(monkeypatch):
    """48 agents of 0.1 s each on 4 threads (`MAX_THREADS` lowered to make them queue: 1.2 s in
    all) under a 0.4 s timeout: all answer (timed from when each started, not from when it was
    queued, which ended most as `timeout`); one that runs 1 s times out. At its real size the pool
    has a thread per agent: 200 agents of 0.2 s take about 0.2 s, not 200 / (cpus + 4) x 0.2 s."""
    from xray.run.episodes import agent_threads
    from xray.run.episodes.agent_threads import AgentThreads

    def agent(seconds):
        time.sleep(seconds)
        return seconds

    async def play(threads, seconds, timeout_s):
        async def one(s):
            try:
                return await threads.call(agent, timeout_s, s)
            except asyncio.TimeoutError:
                return "timeout"
        try:
            return await asyncio.gather(*map(one, seconds))
        finally:
            threads.close()

    monkeypatch.setattr(agent_threads, "MAX_THREADS", 4)
    started = time.perf_counter()
    got = asyncio.run(play(AgentThreads(49), [0.1] * 48 + [1.0], 0.4))
    assert got == [0.1] * 48 + ["timeout"] and time.perf_counter() - started > 1.1

    monkeypatch.setattr(agent_threads, "MAX_THREADS", 1024)
    started = time.perf_counter()
    assert asyncio.run(play(AgentThreads(200), [0.2] * 200, 1.0)) == [0.2] * 200
    assert time.perf_counter() - started < 1.0
