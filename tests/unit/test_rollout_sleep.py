"""`rollout.sleep`: the plan's auto rule, the vLLM engine's flag and methods, and when the trainers
put the rollout to sleep and wake it, all without a GPU (fakes stand in for vLLM and the models);
and the other thing a rollout sharing the actor's devices changes: its sync does not overlap."""
import asyncio
import dataclasses
import re
import types
from pathlib import Path

import pytest
import torch

from xray.config import ConfigError
from xray.sync import SyncReport
from algorithms.specs import command_spec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GPU_1X, GPU_8X, TINY = (str(ROOT / "configs" / n) for n in ("ppo_gpu_1x.yaml", "ppo_gpu_8x.yaml", "ppo_tiny_cpu.yaml"))


def plan_of(*argv):
    from xray.run.models import role_init_kwargs
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["ppo", *argv])
    backend = plan.role("rollout").backend
    return plan.rollout_sleep, role_init_kwargs(cfg, "rollout", backend, "m").get("sleep_mode")


def test_auto_sleeps_exactly_where_vllm_shares_gpus_with_trained_roles():
    assert plan_of("--config", GPU_1X) == (True, True)            # every role on one GPU
    assert plan_of("--config", GPU_8X) == (False, False)          # the rollout has its own GPUs
    assert plan_of("--config", GPU_8X, "--rollout.sleep=true") == (True, True)
    assert plan_of("--config", GPU_1X, "--rollout.sleep=off") == (False, False)
    assert plan_of("--config", TINY) == (False, False)            # CPU: vLLM has no sleep mode
    assert plan_of("--config", GPU_1X, "--backend", "deepspeed-dsinfer") == (False, None)


def test_sleep_on_where_it_cannot_sleep_says_the_fix():
    with pytest.raises(ConfigError, match=r"a GPU \(it is unsupported on CPU\); set rollout.sleep to auto or false"):
        plan_of("--config", TINY, "--rollout.sleep=on")
    with pytest.raises(ConfigError, match="only the vllm rollout can sleep, this run's is dsinfer"):
        plan_of("--config", GPU_1X, "--backend", "deepspeed-dsinfer", "--rollout.sleep=true")
    with pytest.raises(ConfigError, match=re.escape("rollout.sleep: expected 'auto' | bool, got str 'sometimes'")):
        plan_of("--config", GPU_1X, "--rollout.sleep=sometimes")


def test_async_runs_never_sleep():
    from xray.config.plan import rollout_sleeps
    from xray.train import resolve

    _, cfg, _, _, _ = resolve(["ppo", "--config", GPU_1X])
    asynchronous = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, mode="async"))
    assert rollout_sleeps(cfg, "vllm") and not rollout_sleeps(asynchronous, "vllm")
    forced = dataclasses.replace(asynchronous, rollout=dataclasses.replace(cfg.rollout, sleep=True))
    with pytest.raises(ConfigError, match="generates while it trains"):
        rollout_sleeps(forced, "vllm")


def test_engine_flag_and_cpu_refusal():
    from xray.backends.vllm import VllmEngineConfig, VllmEngineError, _prepare_environment

    assert VllmEngineConfig(model_dir="m", device="cuda", sleep_mode=True).llm_kwargs()["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in VllmEngineConfig(model_dir="m", device="cuda").llm_kwargs()
    with pytest.raises(VllmEngineError, match="sleep mode is unsupported on CPU"):
        _prepare_environment(VllmEngineConfig(model_dir="m", device="cpu", sleep_mode=True))


class FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def engine(sleep_mode: bool):
    from xray.backends.vllm import VllmEngine, VllmEngineConfig

    e = object.__new__(VllmEngine)  # no vLLM: the sleep bookkeeping alone
    e.config, e.llm, e.asleep = VllmEngineConfig(model_dir="m", device="cuda", sleep_mode=sleep_mode), FakeLLM(), False
    return e


def test_engine_sleeps_once_wakes_once_and_refuses_work_asleep():
    from xray.backends.vllm import VllmEngineError

    e = engine(sleep_mode=True)
    assert e.sleep() is True and e.sleep() is True
    with pytest.raises(VllmEngineError, match="call wake_up\\(\\) first"):
        e.generate([[1, 2]], {})
    assert e.wake_up() is True and e.wake_up() is False
    assert e.llm.calls == [("sleep", 1), ("wake_up", None)]
    off = engine(sleep_mode=False)  # CPU, or a GPU run with sleeping off
    assert off.sleep() is False and off.wake_up() is False and off.llm.calls == []


class Recorded:
    """A WholeModel stand-in whose methods log their calls and answer at once."""

    def __init__(self, role, log, answers):
        self.role, self.log, self.answers = role, log, answers
        self.parallel = types.SimpleNamespace(dp=1)

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.log.append(f"{self.role}.{name}")
            return self.answers(name, args)
        return lambda *args, **kwargs: call(*args, **kwargs)


def fake_models(log, cfg, plan, rows):
    from xray.data import columns as C
    from xray.data.batch import Batch

    b, t = rows, 5
    exp = Batch({C.INPUT_IDS: torch.ones(b, t, dtype=torch.long), C.ATTENTION_MASK: torch.ones(b, t, dtype=torch.long),
                 C.LOSS_MASK: torch.ones(b, t - 1), C.BEHAVIOUR_LOGPROBS: torch.zeros(b, t - 1)},
                {C.PROMPT_IDS: [[1, 2]] * b, C.RESPONSE_IDS: [[3]] * b})

    def answers(name, args):
        if name == "generate":
            return exp
        if name == "forward":
            return Batch({C.LOGPROBS: torch.zeros(b, t - 1), C.VALUES: torch.zeros(b, t - 1)})
        if name == "train_step":
            return {"loss": 0.0, "approx_kl": 0.0, "update_skipped": 0.0}
        return [True]
    roles = {r: Recorded(r, log, answers) for r in ("actor", "critic", "reference", "rollout")}
    return types.SimpleNamespace(**roles, plan=plan)


@pytest.mark.parametrize("sleeps", [True, False])
def test_ppo_step_sleeps_after_generating_and_wakes_before_the_sync(sleeps):
    from xray.run.step import RLTrainer
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["ppo", "--config", TINY, "--ppo.ppo_epochs=1", "--ppo.rollout_batch_size=32",
                                  "--ppo.mini_batch_size=32", "--data.eval_size=32"])
    log: list[str] = []
    models = fake_models(log, cfg, dataclasses.replace(plan, rollout_sleep=sleeps), rows=32)

    def score(rows, responses):
        return torch.ones(len(responses)), None
    trainer = RLTrainer(cfg, models, score, pad_id=0, stop_ids=[1], algorithm=command_spec("ppo").algorithm(cfg))

    async def sync(exp, version):  # a verified sync: its held counts measured
        log.append("sync")
        return SyncReport(version, 0, 0.0, 0.0, 0.0, held_exact=7, held_functional=8, unchecked=0, held_tensors=15)
    trainer.sync = sync
    metrics = asyncio.run(trainer.step([{"prompt_ids": [1, 2]}] * 32))
    assert (metrics["sync/held_exact"], metrics["sync/held_functional"], metrics["sync/unchecked"]) == (7.0, 8.0, 0.0)
    trained = [e for e in log if e.endswith("train_step")]
    assert sorted(trained) == ["actor.train_step", "critic.train_step"]
    if not sleeps:
        assert "rollout.sleep" not in log and "rollout.wake_up" not in log and "time/rollout_sleep_s" not in metrics
        return
    first_train = log.index(trained[0])
    assert log.index("rollout.generate") < log.index("rollout.sleep") < first_train
    assert log[0] == "rollout.wake_up" and log[-2:] == ["rollout.wake_up", "sync"]
    assert log.count("rollout.sleep") == 1 and log.count("rollout.wake_up") == 2
    assert metrics["time/rollout_sleep_s"] > 0.0 and metrics["time/rollout_wake_s"] > 0.0  # both timed


def test_critic_free_step_sleeps_after_generating_and_wakes_before_the_sync():
    from xray.run.step import RLTrainer
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["grpo", "--config", str(ROOT / "configs/critic_free_tiny_cpu.yaml"),
                                  "--ppo.ppo_epochs=1", "--ppo.rollout_batch_size=8", "--ppo.mini_batch_size=32",
                                  "--data.eval_size=8"])
    log: list[str] = []
    models = fake_models(log, cfg, dataclasses.replace(plan, rollout_sleep=True), rows=32)
    trainer = RLTrainer(cfg, models, lambda rows, responses: (torch.arange(len(responses)).float(), None),
                        pad_id=0, stop_ids=[1], algorithm=command_spec("grpo").algorithm(cfg))

    async def sync(exp, version):  # sync.verify=false: nothing measured
        log.append("sync")
        return SyncReport(version, 0, 0.0, 0.0, float("nan"))
    trainer.sync = sync
    metrics = asyncio.run(trainer.step([{"prompt_ids": [1, 2]}] * 8))
    assert not {"sync/held_exact", "sync/held_functional", "sync/unchecked"} & metrics.keys(), metrics  # absent, not 0
    assert log.index("rollout.generate") < log.index("rollout.sleep") < log.index("actor.train_step")
    assert log[-2:] == ["rollout.wake_up", "sync"] and "critic.train_step" not in log


def test_a_sync_overlaps_only_where_the_rollout_has_devices_of_its_own():
    from xray.run.step import RLTrainer
    from xray.train import resolve

    for config, shared in ((GPU_1X, True), (GPU_8X, False), (TINY, False)):
        _, cfg, plan, _, _ = resolve(["ppo", "--config", config])
        assert plan.shares_devices("actor", "rollout") is shared
        trainer = RLTrainer(cfg, fake_models([], cfg, plan, rows=4), lambda rows, responses: None,
                            pad_id=0, stop_ids=[1], algorithm=command_spec("ppo").algorithm(cfg))
        assert trainer.overlap_sync is not shared
