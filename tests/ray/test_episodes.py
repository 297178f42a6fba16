"""Multi-turn episodes on a real vLLM engine (`xray/run/episodes.py`): token-exact trajectories, a
failing environment that ends only its own episodes, and turns generated while another episode waits.

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

from tests.e2e.test_ppo_e2e import FP32_PROBE
from xray.data import columns as C
from xray.data.trajectory import TrajectoryLimits, pack_trajectories
from xray.env.base import GuessEnv

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
        self.model, self.calls = model, []

    async def generate(self, prompts, sampling):
        started = time.perf_counter()
        out = await self.model.generate(prompts, sampling)
        self.calls.append((started, time.perf_counter(), [list(p) for p in prompts],
                           [list(r) for r in out[C.RESPONSE_IDS]]))
        return out


def test_episodes_are_token_exact_concurrent_and_survive_a_broken_environment(tiny_model, local_ray):
    from transformers import AutoTokenizer

    from xray.run.episodes import EpisodeRunner
    from xray.wholemodel import WholeModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollout = WholeModel.from_pretrained(str(tiny_model), backend="vllm")
    actor = WholeModel.from_pretrained(str(tiny_model), backend="hf")
    try:
        recording = Recording(rollout)
        limits = TrajectoryLimits(max_turns=3, max_turn_tokens=4, max_tokens=100)
        runner = EpisodeRunner(recording, tokenizer, Game, limits, dict(temperature=1.0, seed=7))
        rows = [{"prompt": "guess:", "secret": 5 + i} for i in range(6)]
        rows[0]["delay"], rows[1]["fail"] = 1.5, True
        t0 = time.perf_counter()
        trajectories = asyncio.run(runner.run(rows))
        wall = time.perf_counter() - t0

        engine: dict = {}  # history -> the engine's answers to it (episodes share their prompt)
        for _, _, prompts, answers in recording.calls:
            for p, r in zip(prompts, answers):
                engine.setdefault(tuple(p), []).append(r)
        answers = [tokenizer(a, add_special_tokens=False).input_ids for a in ANSWERS]
        for t in trajectories[2:] + trajectories[:1]:
            assert t.end in ("done", "max_turns", "max_tokens"), (t.end, t.detail)
            for k, (s, e) in enumerate(t.turns):
                history = tuple(t.prompt_ids + t.tokens[:s])
                assert t.tokens[s:e] in [r[:e - s] for r in engine[history]]  # the engine's own ids
                after = t.turns[k + 1][0] if k + 1 < len(t.turns) else len(t.tokens)
                if after > e:
                    assert t.tokens[e:after] in answers and set(t.mask[e:after]) == {0}  # tokenized alone
        broken = trajectories[1]
        assert (broken.end, broken.detail) == ("error", "Game.step: RuntimeError: the game server is down")
        assert runner.stats["ends/error"] == 1

        slow = trajectories[0]
        waits_from = recording.calls[0][1]  # the slow game's first answer: 1.5 s from the first turn's end
        during = [c for c in recording.calls if waits_from < c[0] < waits_from + 1.4]
        assert len(during) >= 2, [round(c[0] - waits_from, 2) for c in recording.calls]  # the others' turns went on
        assert wall < 1.5 * len(slow.turns) + 10

        played = [t for t in trajectories if t.tokens]
        batch = pack_trajectories(played, pad_id=tokenizer.pad_token_id or 0)
        mask = batch[C.LOSS_MASK]
        for row, t in enumerate(played):
            start = len(t.prompt_ids) - 1
            assert mask[row, start:start + len(t.mask)].tolist() == [float(m) for m in t.mask]
        logprobs = actor.forward(batch).get()[C.LOGPROBS]
        gap = ((logprobs - batch[C.BEHAVIOUR_LOGPROBS]).abs() * mask).max().item()
        assert gap <= FP32_PROBE, gap
    finally:
        rollout.shutdown()
        actor.shutdown()
