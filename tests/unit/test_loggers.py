"""The metric loggers of `trainer.loggers` (`xray.run.loggers`): 3 steps logged through a run
directory and read back through each library's own API (`tests/logger_readback.py`); the config
as hyper-parameters; a clean close on success and on failure; a missing package is one line
naming the pip command, before anything starts."""
import importlib.util
import math
import re

import pytest

from tests.logger_readback import (jsonl_rows, mlflow_metric_history, mlflow_run, tensorboard_scalars,
                                   tensorboard_texts, wandb_config, wandb_exit_code, wandb_history, wandb_records)
from xray.config import ConfigError
from xray.run.loggers import LoggerUnavailable, check_loggers
from xray.run.loggers.mlflow_run import flat_params
from xray.run.outputs import RunDir

pytestmark = pytest.mark.unit
CONFIG = {"seed": 1, "ppo": {"kl_coef": 0.01, "gamma": 1.0}, "trainer": {"loggers": ["jsonl", "wandb"]},
          "device_groups": {"train_group": {"ranks": [0, 1], "workers": ["actor"]}}}
STEPS = {1: {"reward/mean": 0.25, "kl": 0.01}, 2: {"reward/mean": 0.5, "kl": 0.02},
         3: {"reward/mean": 0.75, "kl": 0.04, "eval": 0.6}}


@pytest.fixture(autouse=True)
def own_environment(tmp_path, monkeypatch):
    """The loggers' defaults (W&B offline, MLflow's file store) with nothing written to $HOME."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def log_three_steps(path, loggers, fail: bool = False) -> None:
    with RunDir(path, loggers) as run:
        run.write_config(CONFIG)
        for step, metrics in STEPS.items():
            run.log_metrics(step, {**metrics, "note": "text is kept by jsonl only"})
        if fail:
            raise RuntimeError("the run failed")


def expected(key: str) -> list[tuple[int, float]]:
    return [(step, m[key]) for step, m in STEPS.items() if key in m]


def same_history(got: list[tuple[int, float]], key: str) -> bool:
    """Steps equal, values equal to float32 precision (TensorBoard keeps float32)."""
    want = expected(key)
    return [s for s, _ in got] == [s for s, _ in want] and \
        all(math.isclose(v, w, rel_tol=1e-6) for (_, v), (_, w) in zip(got, want))


def test_jsonl_and_tensorboard_are_the_default_and_read_back(tmp_path):
    log_three_steps(tmp_path, ("jsonl", "tensorboard"))
    assert [(r["step"], r["reward/mean"], r["note"]) for r in jsonl_rows(tmp_path)] == \
        [(s, m["reward/mean"], "text is kept by jsonl only") for s, m in STEPS.items()]
    for key in ("reward/mean", "kl", "eval"):
        assert same_history(tensorboard_scalars(tmp_path, key), key), key
    (config_text,) = tensorboard_texts(tmp_path)
    assert "kl_coef: 0.01" in config_text and "train_group" in config_text
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlruns").exists()


def test_mlflow_file_store_records_metrics_params_and_status(tmp_path):
    pytest.importorskip("mlflow")
    log_three_steps(tmp_path / "ok", ("mlflow",))
    for key in ("reward/mean", "kl", "eval"):
        assert mlflow_metric_history(tmp_path / "ok", key) == expected(key)
    run = mlflow_run(tmp_path / "ok")
    assert run.info.status == "FINISHED" and run.info.run_name == "ok"
    assert run.data.params["ppo.kl_coef"] == "0.01" and run.data.params["device_groups.train_group.ranks"] == "[0, 1]"
    assert not (tmp_path / "ok" / "metrics.jsonl").exists()  # only the loggers named

    with pytest.raises(RuntimeError, match="the run failed"):
        log_three_steps(tmp_path / "failed", ("jsonl", "mlflow"), fail=True)
    assert mlflow_run(tmp_path / "failed").info.status == "FAILED"
    assert len(jsonl_rows(tmp_path / "failed")) == 3


def test_wandb_offline_run_records_metrics_config_and_exit(tmp_path):
    pytest.importorskip("wandb")
    log_three_steps(tmp_path / "ok", ("wandb",))
    records = wandb_records(tmp_path / "ok")
    for key in ("reward/mean", "kl", "eval"):
        assert wandb_history(tmp_path / "ok", key, records) == expected(key)
    assert wandb_config(tmp_path / "ok", records)["ppo"] == {"kl_coef": 0.01, "gamma": 1.0}
    assert wandb_exit_code(tmp_path / "ok", records) == 0
    assert any(r.get("run", {}).get("telemetry", {}).get("feature", {}).get("offline") for r in records)

    with pytest.raises(RuntimeError, match="the run failed"):
        log_three_steps(tmp_path / "failed", ("wandb",), fail=True)
    assert wandb_exit_code(tmp_path / "failed") == 1


def test_a_missing_package_is_one_line_with_the_pip_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    for name, package in (("wandb", "wandb>=0.31"), ("mlflow", "mlflow-skinny>=3.17")):
        with pytest.raises(LoggerUnavailable, match=re.escape(f"`pip install '{package}'`, or remove '{name}' from")):
            check_loggers(["jsonl", name])
        with pytest.raises(ConfigError):  # the command line prints it as one line and exits 2
            RunDir(tmp_path / name, ["jsonl", name])
        assert not (tmp_path / name / "metrics.jsonl").exists()
    check_loggers(["jsonl", "tensorboard"])
    with pytest.raises(LoggerUnavailable, match="lists 'jsonl' twice"):
        check_loggers(["jsonl", "jsonl"])
    with pytest.raises(LoggerUnavailable, match="unknown logger 'csv'; choose from jsonl, tensorboard, wandb, mlflow"):
        check_loggers(["csv"])


def test_the_command_line_checks_loggers_before_anything_starts(monkeypatch):
    from xray.train import resolve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(LoggerUnavailable, match="pip install 'wandb>=0.31'"):
        resolve(["ppo", "--trainer.loggers=[jsonl, wandb]"])
    with pytest.raises(ConfigError, match="keep jsonl in trainer.loggers, or set trainer.report=false"):
        resolve(["ppo", "--trainer.loggers=[tensorboard]"])
    _, cfg, _, _, _ = resolve(["ppo", "--trainer.loggers=[tensorboard]", "--trainer.report=false"])
    assert cfg.trainer.loggers == ("tensorboard",)
    with pytest.raises(ConfigError, match="trainer.loggers"):
        resolve(["ppo", "--trainer.loggers=[jsonl, csv]"])
    _, cfg, _, _, _ = resolve(["ppo"])
    assert cfg.trainer.loggers == ("jsonl", "tensorboard")


def test_mlflow_params_are_flat_dotted_keys():
    assert flat_params(CONFIG) == {"seed": "1", "ppo.kl_coef": "0.01", "ppo.gamma": "1.0",
                                   "trainer.loggers": "['jsonl', 'wandb']",
                                   "device_groups.train_group.ranks": "[0, 1]",
                                   "device_groups.train_group.workers": "['actor']"}
