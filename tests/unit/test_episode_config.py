"""The `env` section (episodes in a run): its checks, the rollout's room for a whole episode, the
stop strings that end a model turn, and the environment factory's early error."""
import pytest

from xray.config import ConfigError, load_config
from xray.config.env import response_tokens
from xray.config.plan import plan_run
from algorithms.specs import default_config, command_spec

pytestmark = pytest.mark.unit
DEFAULT = default_config("ppo")


def test_env_settings_are_checked_with_the_fix():
    good = load_config(DEFAULT, ["--env.name=builtin:guess", "--env.max_tokens=64"])
    plan_run(good, "megatron-vllm", command_spec("ppo"))
    assert response_tokens(good) == 64 and response_tokens(load_config(DEFAULT)) == 6  # the rollout's otherwise
    for overrides, fix in [(["--env.max_turn_tokens=200"], "raise env.max_tokens"),
                           (["--env.max_turns=0"], "give 1 or more"),
                           (["--env.name=null", "--env.agent=agent.py:run", "--trainer.mode=async"],
                            "set trainer.mode=sync")]:
        cfg = load_config(DEFAULT, ["--env.name=builtin:guess", *overrides])
        with pytest.raises(ConfigError, match=fix):
            plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="plays no episodes"):
        plan_run(load_config(DEFAULT, ["--env.name=builtin:guess"]), "megatron-vllm", command_spec("sft"))


def test_a_turn_ends_at_the_first_stop_string():
    from xray.data.tokenizer import build_char_tokenizer
    from xray.run.episodes.runner import EpisodeRunner

    tok = build_char_tokenizer()
    runner = EpisodeRunner(None, tok, None, None, {})
    ids = tok("<tool_call>calculator: 2*3</tool_call> and on", add_special_tokens=False).input_ids
    keep = runner.cut(ids, ("</tool_call>",))
    assert tok.decode(ids[:keep]) == "<tool_call>calculator: 2*3</tool_call>"
    assert runner.cut(ids, ()) == runner.cut(ids, ("never",)) == len(ids)


def test_an_environment_that_cannot_be_built_fails_before_the_run(tmp_path):
    from types import SimpleNamespace

    from xray.run.episodes.samples import env_factory
    from xray.env.base import EnvError

    path = tmp_path / "env.py"
    path.write_text("class Needs:\n    def __init__(self, level):\n        self.level = level\n"
                    "    async def reset(self, row):\n        return ''\n"
                    "    async def step(self, action):\n        return '', 0.0, True, {}\n")
    env = SimpleNamespace(name=f"{path}:Needs", kwargs={})
    with pytest.raises(EnvError, match="give the keyword arguments"):
        env_factory(SimpleNamespace(env=env))
    make = env_factory(SimpleNamespace(env=SimpleNamespace(name=env.name, kwargs={"level": 3})))
    assert make().level == 3 and make() is not make()
