"""Six-step asynchronous PPO runs (ColossalChat's shapes) through the real command.

2 makers x 1 trainer on megatron-vllm, then resumed from its step-3 checkpoint; 2 makers x 2
trainers (actor and critic at dp=2) on deepspeed-dsinfer. Each: finite metrics, a verified sync at
every push, staleness never above the bound, changed weights.
"""
import math
import shutil
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_ppo_e2e import config, metrics, tiny_model, train  # noqa: F401 - tiny_model: fixture

pytestmark = pytest.mark.e2e


def async_config(tmp_path: Path, model_dir: Path, backend: str, trainers: int) -> Path:
    path = config(tmp_path, model_dir, backend)
    cfg = yaml.safe_load(path.read_text())
    cfg["device_groups"] = {
        "nproc_per_node": 2 + trainers,
        "train_group": {"device": "CPU", "ranks": list(range(trainers)), "workers": ["actor", "critic", "reference"]},
        "rollout_group": {"device": "CPU", "ranks": [trainers, trainers + 1], "workers": ["rollout"]},
    }
    for role in ("actor", "critic", "reference"):
        cfg[role].update({"tp": 1, "dp": trainers} if backend.startswith("megatron") else {"dp": trainers})
    cfg["trainer"].update(mode="async", steps=6, save_every=3)
    cfg["async"] = {"push_every": 1, "max_staleness": 1, "on_stale": "wait", "buffer_capacity": 2}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def check(steps: dict[int, dict], expected: list[int]) -> None:
    assert sorted(steps) == expected
    for row in steps.values():
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["async/staleness"] <= 1  # the bound
        assert row["sync/max_abs_logprob_diff"] <= 1e-3 and row["async/version"] == row["step"]  # pushed, verified
        assert 0.0 <= row["async/trainer_busy"] <= 1.0 and row["samples_per_s"] > 0


@pytest.mark.parametrize("backend, trainers", [("megatron-vllm", 1), ("deepspeed-dsinfer", 2)])
def test_two_makers_six_steps(tmp_path, tiny_model, backend, trainers):  # noqa: F811 - the fixture
    from safetensors.torch import load_file

    cfg = async_config(tmp_path, tiny_model, backend, trainers)
    run_a = tmp_path / "a"
    out = train("--backend", backend, "--config", str(cfg), "--output-dir", str(run_a))
    assert "eval_before=" in out.stdout and "eval_after=" in out.stdout
    check(metrics(run_a), [1, 2, 3, 4, 5, 6])
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(run_a / "final/actor/model.safetensors"))
    assert max(float((before[k] - after[k]).abs().max()) for k in before) > 0
    if trainers == 1:  # resume from the step-3 checkpoint: steps 4-6 run again
        run_b = tmp_path / "b"
        (run_b / "checkpoints").mkdir(parents=True)
        shutil.copytree(run_a / "checkpoints/step-000003", run_b / "checkpoints/step-000003")
        train("--backend", backend, "--config", str(cfg), "--resume", str(run_b))
        check(metrics(run_b), [4, 5, 6])
