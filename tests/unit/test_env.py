"""Environments (`xray/env/base.py`): the interface, the guard that turns a failure or a timeout into
an episode's end, the loader, and the built-in tool-use and guessing environments."""
import asyncio

import pytest

from xray.env.base import EnvError, EpisodeEnd, GuessEnv, Guarded, ToolEnv, load_env
from xray.env.tools import ToolRegistry

pytestmark = pytest.mark.unit


def run(coro):
    return asyncio.run(coro)


def test_guessing_game_answers_higher_lower_and_rewards_the_find():
    env = GuessEnv()

    async def episode():
        first = await env.reset({"secret": 37})
        turns = [await env.step(a) for a in ("50", "I think 25", "no idea", "37")]
        return first, turns
    first, turns = run(episode())
    assert first == "Guess my number between 1 and 100."
    assert [t[:3] for t in turns] == [(" lower\n", 0.0, False), (" higher\n", 0.0, False),
                                      (" No number in your guess; answer with a number.\n", 0.0, False),
                                      ("", 1.0, True)]
    assert turns[-1][3] == {"guesses": 3}


def test_tool_env_answers_calls_until_a_turn_without_one():
    env = ToolEnv(ToolRegistry.from_specs(["builtin:calculator"]),
                  reward=lambda row, text: float(text.strip().endswith(row["answer"])))

    async def episode():
        first = await env.reset({"prompt": "What is 1234 * 5678?", "answer": "7006652"})
        call = await env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1234*5678"}}</tool_call>')
        end = await env.step("The answer is 7006652")
        return first, call, end
    first, call, end = run(episode())
    assert first == "What is 1234 * 5678?"
    assert call == ("<tool_response>\n7006652\n</tool_response>", 0.0, False, {"tool_calls": 1})
    assert end == ("", 1.0, True, {"tool_calls": 1})


class Flaky:
    async def reset(self, row):
        if row.get("fail"):
            raise RuntimeError("no sandbox today")
        return "start"

    async def step(self, action):
        if action == "hang":
            await asyncio.sleep(10)
        return "ok"  # not a 4-tuple


def test_tool_env_is_built_from_a_configs_kwargs(tmp_path):
    """`env.name: builtin:tools` with `env.kwargs`: tool specs, a reward function's spec (sync or
    async, given the row's columns), the call style by name."""
    judge = tmp_path / "judge.py"
    judge.write_text("async def near(prompts, completions, answer, **_):\n"
                     "    return [float(abs(int(c) - int(a)) <= 1) for c, a in zip(completions, answer)]\n")
    row = {"prompt": "q: 12*3=?", "answer": "36"}
    for reward, final, want in [("xray.rewards.builtin:exact_answer", "36", 1.0), (f"{judge}:near", "35", 1.0),
                                ("xray.rewards.builtin:exact_answer", "35", 0.0)]:
        env = load_env("builtin:tools")(tools=["builtin:calculator"], reward=reward, format="compact",
                                        tool_timeout_s=5.0)

        async def episode():
            await env.reset(row)
            return await env.step("<tool_call>calculator: 12*3</tool_call>"), await env.step(final)
        (observation, _, done, _), (_, score, ended, info) = run(episode())
        assert observation == "<tool_response>36</tool_response>" and not done
        assert (score, ended, info) == (want, True, {"tool_calls": 1}), reward
    with pytest.raises(EnvError, match="builtin:tools reward"):
        ToolEnv(tools=[], reward="no_such_module:fn")


def test_a_failing_or_slow_environment_ends_the_episode_with_a_reason():
    env = Guarded(Flaky(), timeout_s=0.2)
    assert run(env.reset({})) == "start"
    assert run(env.reset({"fail": True})) == EpisodeEnd("error", "Flaky.reset: RuntimeError: no sandbox today")
    assert run(env.step("hang")) == EpisodeEnd("timeout", "Flaky.step took more than 0.2 s")
    assert run(env.step("go")) == EpisodeEnd("error", "Flaky.step returned str, not (observation, reward, done, info)")


def test_environments_load_by_name_and_bad_names_say_the_fix(tmp_path):
    assert load_env("builtin:guess") is GuessEnv and load_env("builtin:tools") is ToolEnv
    good = tmp_path / "my_env.py"
    good.write_text("class Echo:\n    async def reset(self, row):\n        return row['prompt']\n"
                    "    async def step(self, action):\n        return action, 0.0, True, {}\n"
                    "class Sync:\n    def reset(self, row):\n        return ''\n")
    assert load_env(f"{good}:Echo").__name__ == "Echo"
    with pytest.raises(EnvError, match="unknown built-in environment 'builtin:maze'.*builtin:guess, builtin:tools"):
        load_env("builtin:maze")
    with pytest.raises(EnvError, match="needs async methods reset\\(row\\) and step\\(action\\); reset and step are"):
        load_env(f"{good}:Sync")
    with pytest.raises(EnvError, match="no file"):
        load_env("/no/such/env.py:Env")
