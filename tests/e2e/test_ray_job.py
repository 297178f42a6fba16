"""The default job submitted to a running Ray cluster with `ray job submit`, as the README shows.

One short run proves several points of what a user sees: the shared session head
(`tests/ray_head.py`: `ray start --head` on 127.0.0.1; authentication off, see there) runs
`python -m xray.train ppo` (the default config: the built-in tiny Llama warm-started, `builtin:arith`,
3 steps) with every logger on; the job succeeds and prints its result line; its console output
(`ray job logs`: the entrypoint's stdout and stderr) has no library start-up warning and at most 15
lines besides the progress bars'; the run report renders; TensorBoard, W&B (offline) and MLflow
(local file store) each hold the metrics of the 3 steps, read back through their own APIs.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console_lines import noise_lines, non_progress_lines, progress_lines
from tests.logger_readback import mlflow_metric_history, tensorboard_scalars, wandb_history

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
STEPS = 3


def ray_cli(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_default_job_through_ray_job_submit(ray_head, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, **ray_head.env}
    # the job's environment is the cluster's, plus this: the session's cache, whose warm start
    # `test_learning.py` built (the same key: seed, task, backend and warm-start settings)
    runtime_env = {"env_vars": {"XRAY_CACHE": os.environ["XRAY_CACHE"]}}
    submit = ray_cli("job", "submit", "--address", ray_head.dashboard, "--submission-id", "xray-default-job",
                     "--runtime-env-json", json.dumps(runtime_env), "--",
                     sys.executable, "-m", "xray.train", "ppo", f"--output-dir={run}", f"--trainer.steps={STEPS}",
                     f"--trainer.save_every={STEPS}", "--trainer.loggers=[jsonl,tensorboard,wandb,mlflow]", env=env)
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-6000:]
    assert "Job 'xray-default-job' succeeded" in submit.stdout + submit.stderr
    logs = ray_cli("job", "logs", "--address", ray_head.dashboard, "xray-default-job", env=env, timeout=60)
    assert logs.returncode == 0, logs.stderr[-3000:]
    header, marker, console = logs.stdout.partition("Running entrypoint for job xray-default-job")
    assert marker, logs.stdout[-3000:]
    console = console.split("\n", 1)[1]  # the entrypoint's own stdout and stderr, after Ray's header lines
    result = re.search(r"^eval_before=(\d\.\d{4}) eval_after=(\d\.\d{4})$", console, re.M)
    assert result, console[-3000:]
    assert float(result[1]) > 0.2  # the warm start made a model that is sometimes right

    assert noise_lines(console) == [], noise_lines(console)
    assert len(non_progress_lines(console)) <= 15, "\n".join(non_progress_lines(console))
    assert any("ppo" in line for line in progress_lines(console))

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("reward/mean" in r for r in rows)
    expected = {key: [(r["step"], r[key]) for r in rows] for key in ("reward/mean", "kl", "actor/loss")}
    for key, history in expected.items():  # each logger holds every step's value, read back by its own API
        assert close(tensorboard_scalars(run, key), history), key
        assert close(mlflow_metric_history(run, key), history), key
        assert close(wandb_history(run, key), history), key
    report = run / "report"
    assert (report / "index.html").stat().st_size > 2000
    pngs = sorted(report.glob("*.png"))
    assert {"reward.png", "eval.png", "kl.png", "timeline.png"} <= {p.name for p in pngs}
    assert all(p.stat().st_size > 8000 and p.name in (report / "index.html").read_text() for p in pngs)


def close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    return [s for s, _ in got] == [s for s, _ in want] and all(
        abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(got, want))
