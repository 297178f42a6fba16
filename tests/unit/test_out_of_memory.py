"""A node out of memory: the run ends with its largest processes and the overrides that lower them.

Ray's text below is a real one (trimmed where it repeats), from the asynchronous multi-turn run on
SmolLM2-135M-Instruct that Ray's memory monitor killed on a 24 GB machine.
"""
import dataclasses

import pytest

from xray.config import CONFIG_DIR, load_config
from xray.config.plan import plan_run

pytestmark = pytest.mark.unit

RAY_TEXT = """6 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, ID: b814a66fdb2c77967534897cfba919efbf150bda049adc7be8554d2f) was 22.38GB used / 23.54GB limit (0.950731)
OOM kill reason: Memory usage 24031162368B exceeded threshold of 24012685312B (95.0% of 25276510208B limit)
Object store memory usage: [- objects spillable: 10
- bytes spillable: 1614283144
]
Total non-selected idle workers: 0
Top 10 memory users: PID\tMEM(GB)\tCOMMAND
25026\t6.93\tray::TrainWorkhorse.call
25029\t5.92\tray::TrainWorkhorse.call
25132\t2.51\tray::RolloutWorkhorse
25106\t2.50\tray::RolloutWorkhorse
25075\t0.82\tray::TrainWorkhorse
24659\t0.37\t.venv/bin/python -m xray.train ppo --config configs/ppo_async_2makers_1trainer.yaml --model.path=/tm...
25809\t0.25\tray::ExperienceMaker
Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html."""

CONFIG = CONFIG_DIR / "ppo_async_2makers_1trainer.yaml"
OVERRIDES = ["--actor.micro_batch_size=4", "--critic.micro_batch_size=4"]


def _run():
    from xray.commands import load

    cfg = load_config(CONFIG, OVERRIDES)
    return cfg, plan_run(cfg, "megatron-vllm", load("ppo"))


def test_the_message_names_the_node_the_largest_processes_and_overrides_that_load():
    import ray

    from xray.run.out_of_memory import explain

    cfg, plan = _run()
    message = explain(ray.exceptions.OutOfMemoryError(RAY_TEXT), cfg, plan)
    assert message.startswith("the node ran out of memory (22.38 GB used of 23.54 GB)")
    assert "6.93 GB TrainWorkhorse (pid 25026); 5.92 GB TrainWorkhorse (pid 25029); 2.51 GB RolloutWorkhorse" in message
    assert "0.37 GB python (pid 24659)" in message  # the driver, named by its program
    overrides = [line.split()[0] for line in message.splitlines() if line.startswith("  --")]
    assert overrides[:6] == ["--actor.activation_checkpointing=true", "--critic.activation_checkpointing=true",
                             "--trainer.memory_snapshots=false", "--actor.micro_batch_size=2",
                             "--critic.micro_batch_size=2", "--model.dtype=bfloat16"]  # the largest effect first
    # every override it names is one the command takes, and changes what it says it changes
    changed = load_config(CONFIG, OVERRIDES + [o for o in overrides if "=" in o])
    assert changed.actor.activation_checkpointing and changed.critic.micro_batch_size == 2
    assert not changed.trainer.memory_snapshots and changed.model.dtype == "bfloat16"
    # settings already lowered are not suggested again
    assert "activation_checkpointing" not in explain(ray.exceptions.OutOfMemoryError(RAY_TEXT), changed, plan)


def test_found_through_a_chain_and_only_there():
    from xray.run.out_of_memory import explain

    cfg, plan = _run()
    try:
        try:
            raise RuntimeError("actor.train_step failed on 1 of 1 shards (ranks [0]):\n  ranks [0]: " + RAY_TEXT)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert explain(outer, cfg, plan).startswith("the node ran out of memory")
    assert explain(RuntimeError("a shard's process is gone"), cfg, plan) is None


def test_the_command_writes_it_instead_of_a_traceback(monkeypatch, capsys):
    import ray

    import xray.train

    spec = xray.train.load("ppo")

    def command(*args):
        raise ray.exceptions.OutOfMemoryError(RAY_TEXT)

    monkeypatch.setattr(xray.train, "load", lambda name: dataclasses.replace(spec, command=command))
    monkeypatch.setattr(xray.train, "shutdown_ray", lambda: None)
    monkeypatch.setattr(xray.train, "setup_console", lambda level: None)
    assert xray.train.main(["ppo", "--config", str(CONFIG)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: the node ran out of memory (22.38 GB used of 23.54 GB)")
    assert "Traceback" not in err

