"""The default job learns, through the real distributed pipeline, over two seeds; and it runs as a
Ray job the way the README shows.

`python -m xray.train ppo`, the default job (the built-in tiny Llama warm-started by supervised
fine-tuning, `builtin:arith`, Megatron actor, critic and reference, a vLLM rollout, every weight sync
verified), shortened to `STEPS` steps, for each of two seeds. The warm start is built once, by the
first run, into the session's `XRAY_CACHE`, and both seeds start from it. Greedy accuracy on the
200 held-out prompts is measured by the rollout engine before and after training, so a step that
trains the wrong way (a flipped policy-loss sign, a broken advantage) lowers it, and a sync that
never reaches the engine leaves it exactly where it was: each seed must gain `MIN_GAIN`, the two
together `MEAN_GAIN` on average.

One short run proves several points: the first seed is submitted with `ray job submit` to the
session's shared head (`tests/ray_head.py`: `ray start --head` on 127.0.0.1; authentication off,
see there) with every logger on. The job succeeds and prints its result line; its console output
(`ray job logs`: the entrypoint's stdout and stderr) has no library start-up warning and at most 15
lines besides the progress bars'; the run report renders; TensorBoard, W&B (offline) and MLflow
(local file store) each hold every step's metrics, read back through their own APIs.
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
from tests.e2e.test_ppo_e2e import check_held
from tests.logger_readback import mlflow_metric_history, tensorboard_scalars, wandb_history

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
STEPS = 25
MIN_GAIN = 0.05
"""Each seed's gain in greedy accuracy (out of 1); see the module docstring for what it catches."""
MEAN_GAIN = 0.08
RESULT = re.compile(r"^eval_before=(\d\.\d{4}) eval_after=(\d\.\d{4})$", re.M)


def ray_cli(*args: str, env: dict, timeout: float = 800) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), *args], env=env, capture_output=True, text=True, timeout=timeout)


def submitted_run(ray_head, run: Path, seed: int) -> tuple[float, float]:
    """The default job as a Ray job with every logger on; (eval before, eval after)."""
    env = {**os.environ, **ray_head.env}
    runtime_env = {"env_vars": {"XRAY_CACHE": os.environ["XRAY_CACHE"]}}  # the job's env is the cluster's, plus this
    submit = ray_cli("job", "submit", "--address", ray_head.dashboard, "--submission-id", "xray-default-job",
                     "--runtime-env-json", json.dumps(runtime_env), "--",
                     sys.executable, "-m", "xray.train", "ppo", f"--output-dir={run}", f"--seed={seed}",
                     f"--trainer.steps={STEPS}", f"--trainer.save_every={STEPS}",
                     "--trainer.loggers=[jsonl,tensorboard,wandb,mlflow]", env=env)
    assert submit.returncode == 0, (submit.stdout + submit.stderr)[-6000:]
    assert "Job 'xray-default-job' succeeded" in submit.stdout + submit.stderr
    logs = ray_cli("job", "logs", "--address", ray_head.dashboard, "xray-default-job", env=env, timeout=60)
    assert logs.returncode == 0, logs.stderr[-3000:]
    header, marker, console = logs.stdout.partition("Running entrypoint for job xray-default-job")
    assert marker, logs.stdout[-3000:]
    console = console.split("\n", 1)[1]  # the entrypoint's own stdout and stderr, after Ray's header lines
    result = RESULT.search(console)
    assert result, console[-3000:]
    assert noise_lines(console) == [], noise_lines(console)
    assert len(non_progress_lines(console)) <= 15, "\n".join(non_progress_lines(console))
    assert any("ppo" in line for line in progress_lines(console))
    loggers_hold_every_step(run)
    report = run / "report"
    assert (report / "index.html").stat().st_size > 2000
    pngs = sorted(report.glob("*.png"))
    assert {"reward.png", "eval.png", "kl.png", "timeline.png"} <= {p.name for p in pngs}
    assert all(p.stat().st_size > 8000 and p.name in (report / "index.html").read_text() for p in pngs)
    return float(result[1]), float(result[2])


def loggers_hold_every_step(run: Path) -> None:
    """TensorBoard, MLflow and W&B each hold every step's value, read back by their own APIs."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = {key: [(r["step"], r[key]) for r in rows] for key in ("reward/mean", "kl", "actor/loss")}
    for key, history in expected.items():
        assert close(tensorboard_scalars(run, key), history), key
        assert close(mlflow_metric_history(run, key), history), key
        assert close(wandb_history(run, key), history), key


def close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    return [s for s, _ in got] == [s for s, _ in want] and all(
        abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(got, want))


def direct_run(run: Path, seed: int, model: Path) -> tuple[float, float]:
    p = subprocess.run([sys.executable, "-m", "xray.train", "ppo", f"--output-dir={run}", f"--seed={seed}",
                        f"--model.path={model}", f"--trainer.steps={STEPS}", "--trainer.save_every=0",
                        "--trainer.report=false", "--trainer.loggers=[jsonl]"],
                       cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-6000:]
    result = RESULT.search(p.stdout)
    assert result, p.stdout[-2000:]
    return float(result[1]), float(result[2])


def warm_started_model() -> Path:
    """The built-in model's warm start that the first run built in the session cache."""
    found = sorted((Path(os.environ["XRAY_CACHE"]) / "builtin").glob("tiny-llama-sft-*/model.safetensors"))
    assert len(found) == 1, found
    return found[0].parent


def test_default_job_learns_over_two_seeds_first_as_a_ray_job(ray_head, tmp_path):
    evals = {1: submitted_run(ray_head, tmp_path / "seed1", 1)}
    evals[2] = direct_run(tmp_path / "seed2", 2, warm_started_model())
    for seed, (before, _) in evals.items():
        assert before > 0.2, evals  # the warm start made a model that is sometimes right
        rows = [json.loads(line) for line in (tmp_path / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:  # every step's sync reached the engine and was checked there, tensor by tensor
            assert r["sync/version"] == r["step"], r
            check_held(r, "megatron-vllm", replicas=1)
    gains = {seed: after - before for seed, (before, after) in evals.items()}
    print(f"greedy accuracy gains by seed: {gains}")
    assert min(gains.values()) >= MIN_GAIN, gains
    assert sum(gains.values()) / len(gains) >= MEAN_GAIN, gains
