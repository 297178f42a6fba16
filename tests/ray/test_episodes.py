"""Multi-turn episodes on a real vLLM engine: the episode runner (`xray/run/episodes/runner.py`) with
token-exact trajectories, a failing environment that ends only its own episodes, and turns
generated while another episode waits; agents written with the `openai` client through the
OpenAI-compatible endpoint (`xray/run/episodes/endpoint.py`); and the built-in calculator task with
the tool's answers in its trajectories. One engine (the tiny model, first taught the calculator
call's shape by a few supervised steps) serves the three tests.

The tiny model (character tokenizer) plays the guessing game (`GuessEnv`) for 3 turns of up to 4
tokens. Every generate call is recorded: each model turn of each trajectory must be the engine's
own ids for that trajectory's history, each observation the game's answer tokenized alone; the loss
mask is 0 on every observation token, and the actor's log-probs of the model tokens (the Hugging
Face model) equal the engine's behaviour log-probs within the sync tolerance. One episode's game
takes 1.5 s per answer: the others' turns are generated meanwhile. Another's raises: that episode
ends with reason `error`, the rest go on.
"""
import asyncio
import time

import pytest
import torch

from tests.e2e.test_ppo_e2e import FP32_PROBE
from xray.backends.sampling import RESPONSE_LOGPROBS
from xray.data import columns as C
from xray.data.trajectory import TrajectoryLimits, pack_trajectories
from xray.env.base import GuessEnv
from xray.env.tasks import CalculatorEnv, CalculatorTask, demonstration_ids

pytestmark = pytest.mark.ray

ANSWERS = (" higher\n", " lower\n", " No number in your guess; answer with a number.\n")


class Game(GuessEnv):
    """The guessing game; a row may be slow (`delay` seconds per answer) or broken (`fail`)."""

    async def reset(self, row):
        self.row = row
        return await super().reset(row)

    async def step(self, action):
        if self.row.get("fail"):
            raise RuntimeError("the game server is down")
        await asyncio.sleep(self.row.get("delay", 0.0))
        return await super().step(action)


class Recording:
    """The rollout model, with every generate call's start and end times, prompts and answers kept."""

    def __init__(self, model):
        self.model, self.calls, self.stops = model, [], []

    async def generate(self, prompts, sampling):
        self.stops.append(sampling.get("stop"))
        started = time.perf_counter()
        out = await self.model.generate(prompts, sampling)
        self.calls.append((started, time.perf_counter(), [list(p) for p in prompts],
                           [list(r) for r in out[C.RESPONSE_IDS]],
                           [[float(x) for x in lp] for lp in out[RESPONSE_LOGPROBS]]))
        return out


def teach_the_call_shape(model_dir, tokenizer, out_dir, steps: int = 100):
    """`model_dir` fine-tuned on the first turn of calculator demonstrations (prompt, call) for
    `steps` batches of 16 on one thread, saved in `out_dir`."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    firsts = []
    for row in CalculatorTask().rows(256, seed=9):
        seq, mask = demonstration_ids(row, tokenizer)
        end = seq.index(tokenizer.eos_token_id) + 1
        firsts.append(([t if m else -100 for t, m in zip(seq[:end], mask[:end])], seq[:end]))
    labels = torch.tensor([lab for lab, _ in firsts])  # all the same length: 4 and 2 digits
    ids = torch.tensor([seq for _, seq in firsts])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        for step in range(steps):
            pick = torch.arange(step * 16, step * 16 + 16) % len(ids)
            loss = model(input_ids=ids[pick], labels=labels[pick]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def engines(tiny_model, local_ray, tmp_path_factory):
    """(tokenizer, a vLLM rollout WholeModel, the Hugging Face actor) of the tiny model taught the
    calculator call's shape (the other tests do not mind what it writes)."""
    from transformers import AutoTokenizer

    from xray.wholemodel import WholeModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model_dir = teach_the_call_shape(tiny_model, tokenizer, tmp_path_factory.mktemp("taught"))
    rollout = WholeModel.from_pretrained(str(model_dir), backend="vllm", stop_strings=True)  # the tools' stops
    actor = WholeModel.from_pretrained(str(model_dir), backend="hf")
    try:
        yield tokenizer, rollout, actor
    finally:
        rollout.shutdown()
        actor.shutdown()


def assert_token_exact(trajectories, recording, observations, tokenizer, actor,
                       observations_checked: bool = False) -> None:
    """Each model turn is the engine's own ids for its history; each observation one of
    `observations` tokenized alone, out of the loss; the actor's log-probs of the model tokens
    equal the engine's within the sync tolerance."""
    engine: dict = {}  # history -> the engine's answers to it (episodes share their prompt)
    for _, _, prompts, answers, _ in recording.calls:
        for p, r in zip(prompts, answers):
            engine.setdefault(tuple(p), []).append(r)
    answers = [tokenizer(a, add_special_tokens=False).input_ids for a in observations]
    for t in trajectories:
        for k, (s, e) in enumerate(t.turns):
            history = tuple(t.prompt_ids + t.tokens[:s])
            assert t.tokens[s:e] in [r[:e - s] for r in engine[history]]  # the engine's own ids
            after = t.turns[k + 1][0] if k + 1 < len(t.turns) else len(t.tokens)
            if after > e:
                assert observations_checked or t.tokens[e:after] in answers  # tokenized alone
                assert set(t.mask[e:after]) == {0}
    batch = pack_trajectories(trajectories, pad_id=tokenizer.pad_token_id or 0)
    mask = batch[C.LOSS_MASK]
    for row, t in enumerate(trajectories):
        start = len(t.prompt_ids) - 1
        assert mask[row, start:start + len(t.mask)].tolist() == [float(m) for m in t.mask]
    logprobs = actor.forward(batch).get()[C.LOGPROBS]
    gap = ((logprobs - batch[C.BEHAVIOUR_LOGPROBS]).abs() * mask).max().item()
    assert gap <= FP32_PROBE, gap


def test_episodes_are_token_exact_concurrent_and_survive_a_broken_environment(engines):
    from xray.run.episodes.runner import EpisodeRunner

    tokenizer, rollout, actor = engines
    recording = Recording(rollout)
    limits = TrajectoryLimits(max_turns=3, max_turn_tokens=4, max_tokens=100)
    runner = EpisodeRunner(recording, tokenizer, Game, limits, dict(temperature=1.0, seed=7))
    rows = [{"prompt": "guess:", "secret": 5 + i} for i in range(6)]
    rows[0]["delay"], rows[1]["fail"] = 1.5, True
    t0 = time.perf_counter()
    trajectories = asyncio.run(runner.run(rows))
    wall = time.perf_counter() - t0

    for t in trajectories[2:] + trajectories[:1]:
        assert t.end in ("done", "max_turns", "max_tokens"), (t.end, t.detail)
    broken = trajectories[1]
    assert (broken.end, broken.detail) == ("error", "Game.step: RuntimeError: the game server is down")
    assert runner.stats["ends/error"] == 1
    assert_token_exact([t for t in trajectories if t.tokens], recording, ANSWERS, tokenizer, actor)

    slow = trajectories[0]
    waits_from = recording.calls[0][1]  # the slow game's first answer: 1.5 s from the first turn's end
    during = [c for c in recording.calls if waits_from < c[0] < waits_from + 1.4]
    assert len(during) >= 2, [round(c[0] - waits_from, 2) for c in recording.calls]  # the others' turns went on
    assert wall < 1.5 * len(slow.turns) + 10, (wall, [(round(a - t0, 2), round(b - a, 2)) for a, b, *_ in recording.calls])


async def openai_agent(base_url: str, turns: int) -> list[str]:
    """A plain `openai` client loop, as an agent author writes it: ask, read, answer, ask again."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "guess:"}]
    for turn in range(turns):
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if turn + 1 < turns:
            messages.append({"role": "user", "content": " higher"})
    await client.close()
    return [m["content"] for m in messages]


def test_an_openai_client_agent_through_the_endpoint_is_token_exact_and_batched(engines):
    """Six agents written with the `openai` client, unchanged, play 3 turns each at once through
    the endpoint: their sessions' trajectories are token-exact (the engine's ids, the user's
    replies tokenized alone and out of the loss, the actor's log-probs equal the engine's); the
    requests that arrive together share a generate call; a rewritten history is refused (400)."""
    import openai

    from xray.run.episodes.endpoint import AgentEndpoint

    tokenizer, rollout, actor = engines
    recording = Recording(rollout)
    limits = TrajectoryLimits(max_turns=3, max_turn_tokens=4, max_tokens=100)
    endpoint = AgentEndpoint(recording, tokenizer, limits, dict(temperature=1.0, seed=5,
                                                                stop_token_ids=[tokenizer.eos_token_id]))

    async def main():
        await endpoint.start()
        try:
            sessions = [endpoint.open() for _ in range(6)]
            texts = await asyncio.gather(*[openai_agent(url, 3) for _, url in sessions])
            sid, url = endpoint.open()
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
            first = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
            with pytest.raises(openai.BadRequestError, match="as the endpoint returned it"):
                await client.chat.completions.create(model="tiny", messages=[
                    {"role": "user", "content": "a"}, {"role": "assistant", "content": first.choices[0].message.content + "x"},
                    {"role": "user", "content": "b"}])
            await client.close()
            return [endpoint.close(s)[0] for s, _ in sessions], texts
        finally:
            await endpoint.stop()

    trajectories, texts = asyncio.run(main())
    for t, said in zip(trajectories, texts):
        assert len(t.turns) == 3 and t.mask.count(0) == 2 * len(tokenizer(" higher", add_special_tokens=False).input_ids)
        assert [tokenizer.decode(t.tokens[s:e], skip_special_tokens=True) for s, e in t.turns] == said[1::2]
    assert_token_exact(trajectories, recording, [" higher"], tokenizer, actor)
    assert len(recording.calls) <= 3 * 2, len(recording.calls)  # 18 turns: the sessions' requests batched


def test_calculator_episodes_are_token_exact_with_the_tools_answers(engines):
    """The built-in calculator task (`xray/env/tasks.py`): each model turn is the engine's own ids
    and log-probs (mask 1), each observation exactly the `CalculatorEnv`'s answer to that turn's
    text, tokenized alone (mask 0, log-prob 0); all episodes but one at most called the tool
    (greedy turns: deterministic); the engine is given the call's closing tag and stops at it; the
    actor's log-probs equal the engine's."""
    from xray.run.episodes.runner import EpisodeRunner

    tokenizer, rollout, actor = engines
    recording = Recording(rollout)
    limits = TrajectoryLimits(max_turns=3, max_turn_tokens=48, max_tokens=110)
    runner = EpisodeRunner(recording, tokenizer, CalculatorEnv, limits, dict(temperature=0.0, seed=5))
    rows = [dict(r, prompt_ids=tokenizer(r["prompt"]).input_ids) for r in CalculatorTask().rows(6, seed=4)]
    trajectories = asyncio.run(runner.run(rows))

    engine: dict = {}  # history -> the engine's answers to it, with their log-probs
    for _, _, prompts, answers, logprobs in recording.calls:
        for p, r, lp in zip(prompts, answers, logprobs):
            engine.setdefault(tuple(p), []).append((r, lp))
    observations = 0
    for row, t in zip(rows, trajectories):
        assert t.end in ("done", "max_turns", "max_tokens"), (t.end, t.detail)
        env = CalculatorEnv()
        asyncio.run(env.reset(row))
        assert len(t.logprobs) == len(t.mask) == len(t.tokens)
        for k, (s, e) in enumerate(t.turns):
            turn = (t.tokens[s:e], t.logprobs[s:e])
            assert turn in [(r[:e - s], lp[:e - s]) for r, lp in engine[tuple(t.prompt_ids + t.tokens[:s])]]
            assert set(t.mask[s:e]) == {1}
            after = t.turns[k + 1][0] if k + 1 < len(t.turns) else len(t.tokens)
            if after > e:  # the environment's answer to this turn, tokenized alone, never trained on
                text = tokenizer.decode(t.tokens[s:e], skip_special_tokens=True)
                observation = asyncio.run(env.step(text))[0]
                assert t.tokens[e:after] == tokenizer(observation, add_special_tokens=False).input_ids
                assert observation.startswith("<tool_response>") and set(t.mask[e:after]) == {0}
                assert set(t.logprobs[e:after]) == {0.0}
                observations += 1
    assert observations >= len(rows) - 1, [tokenizer.decode(t.tokens) for t in trajectories]
    assert recording.stops and set(map(tuple, recording.stops)) == {("</tool_call>",)}  # the engine is given the stop
    for _, _, _, answers, _ in recording.calls:  # and stops there, not at max_turn_tokens
        for r in answers:
            text = tokenizer.decode(r, skip_special_tokens=True)
            assert "</tool_call>" not in text or text.endswith("</tool_call>"), text
    assert_token_exact(trajectories, recording, [], tokenizer, actor, observations_checked=True)
