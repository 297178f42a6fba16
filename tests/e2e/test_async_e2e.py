"""Six-step asynchronous PPO runs (ColossalChat's shapes) through the real command.

2 makers x 1 trainer and 2 makers x 2 trainers (actor and critic at dp=2, each trainer fed by its
own maker and trainer 1 pushing to both makers), on both backend pairs. Each: finite metrics, a
verified sync at every push (each arrives while the next step trains), staleness never above the
bound, busy shares within their measured windows, both makers feeding the trainers, changed
weights, the graph obeyed; the step-3 checkpoint holds every prompt drawn (trained, buffered, or
in the making). Both runs (one per pair) SIGKILL a rollout Workhorse once step 1 is logged: its
maker is replaced while the trainer and the other maker go on (every step logged once, the step
counter never goes back), the log names the replacement, no group queued in the buffer is lost
with the killed maker (the buffer owns them: `async/requeued_lost` stays 0), stdout holds the
result line only (none of Ray's worker-death text), and the step-3 checkpoint's accounting still
holds every prompt exactly once. Each also resumes: 2 makers x 2 trainers from that checkpoint,
which queues the prompts again and completes steps 4-6; 2 makers x 1 trainer after a SIGTERM to
its driver once step 2 is logged (exit 0 within 15 s, the last checkpoint holding every prompt
drawn, every step logged once after `--resume`).
The 2 makers x 2 trainers run on deepspeed-dsinfer has a teacher (dp=2) score every group in the
makers (`distill.teacher_coef`), its term added by the trainers.
The 2 makers x 1 trainer run plays multi-turn episodes (`env.name`: the guessing game of
`tests/e2e/answer_guess.py`, up to 3 turns): PPO with its critic on trajectories the makers played,
whose turns may span weight versions, each model token checked end to end against the actor.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.e2e.answer_guess import ANSWER_GUESS
from tests.e2e.test_ppo_e2e import FP32_PROBE, ROOT, check_held, config, metrics, sigterm_once_logged, train

pytestmark = pytest.mark.e2e


def async_config(tmp_path: Path, model_dir: Path, backend: str, trainers: int, env: dict | None = None,
                 teacher: Path | None = None) -> Path:
    path = config(tmp_path, model_dir, backend, teacher=teacher)
    cfg = yaml.safe_load(path.read_text())
    roles = ["actor", "critic", "reference"] + (["teacher"] if teacher is not None else [])
    if env:
        cfg["env"] = dict(env)
    cfg["device_groups"] = {
        "nproc_per_node": 2 + trainers,
        "train_group": {"device": "CPU", "ranks": list(range(trainers)), "workers": roles},
        "rollout_group": {"device": "CPU", "ranks": [trainers, trainers + 1], "workers": ["rollout"]},
    }
    for role in roles:
        cfg[role].update({"tp": 1, "dp": trainers} if backend.startswith("megatron") else {"dp": trainers})
    cfg["trainer"].update(mode="async", steps=6, save_every=3, report=False)  # the report: test_ppo_e2e
    cfg["async"] = {"push_every": 1, "max_staleness": 1, "on_stale": "wait", "buffer_capacity": 2,
                    "max_in_flight": 2}  # at most 2 prompts in flight per maker: both makers feed each step
    if trainers == 2:
        cfg["async"].update(feeds={"maker0": ["trainer0"], "maker1": ["trainer1"]},
                            pushes={"trainer1": ["maker0", "maker1"]})
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def check(steps: dict[int, dict], expected: list[int], trainers: int, backend: str, killed: bool = False,
          prompts: int = 8, paired: bool = True) -> None:
    """A push is reported with the step during which every maker answered it (loaded, or skipped
    for a newer version): usually the next step, a step later when a maker was mid-segment (the
    fresh-clone CI at 011264d saw step 2 end first); `killed`: a maker was lost during the run, so
    a push's loads may count one replica. `prompts`: the run's rollout_batch_size; `paired`: with 2
    trainers, maker d feeds trainer d alone (else every maker feeds both)."""
    assert sorted(steps) == expected
    unreported = [step for step, row in steps.items() if step - 1 in steps and "sync/version" not in row]
    assert len(unreported) <= 1 + int(killed), unreported
    last = -1
    for step, row in sorted(steps.items()):
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["async/staleness"] <= 1  # the bound
        if "sync/version" in row:  # the pushes answered since the last report, each verified
            version, pushes = int(row["sync/version"]), int(row["sync/pushes_verified"])
            assert last < version <= step - 1 and 1 <= pushes <= version - last, (last, row)
            assert row.get("sync/max_abs_logprob_diff", 0.0) <= FP32_PROBE, row
            loaded = int(row["sync/replicas_loaded"])  # a maker may skip a push for a newer one
            assert pushes <= loaded <= 2 * pushes and (loaded >= 2 or killed), row
            check_held(row, backend, loaded)  # the makers' engines, every tensor they hold
            last = version
        # busy shares from measured intervals (not clamped): a maker's time counted twice, or
        # outside the step, would pass 1; the trainer trains in every step
        assert 0.0 < row["async/trainer_busy"] and row["async/maker_busy"] <= 1.0 + 1e-9, row
        assert row["samples_per_s"] > 0
        share = prompts // trainers  # rollout_batch_size / trainers groups per trainer and step
        for d in range(trainers):
            made = [row[f"async/trainer{d}_from_maker{i}"] for i in range(2)]
            assert sum(made) == share, row
            if trainers == 2 and paired:  # the graph: maker d feeds trainer d alone
                assert made[1 - d] == 0, row
        # the end-to-end check of the makers' syncs, on the tokens sampled with the trainer's weights
        # (a step may have none: admission lets makers run a version ahead of what is trained)
        assert row["sync/fresh_tokens"] >= 0 and row.get("sync/fresh_gap_max", 0.0) <= FP32_PROBE, row
        assert 0 <= row["sync/versions_since_e2e"] < 10, row  # sync.probe_every: a probe when none checked
    assert sum(row["async/maker_busy"] for row in steps.values()) > 0
    probed = [s for s, row in steps.items() if "sync/max_abs_logprob_diff" in row]
    assert probed and len(probed) < len(steps), probed  # the probe at the first and last pushes only
    if trainers == 1 and len(steps) > 3 and not killed:  # both makers' experience reached the one trainer
        both_makers_fed(steps)  # (a maker lost after step 1 may have given none: its rival made them all)


def check_episodes(steps: dict[int, dict], trained: int) -> None:
    """The makers played every sample as an episode: the steps' counts add up to the `trained`
    samples exactly (each group's counts travel with it, a maker lost or not), some over several
    turns, none ended by a failure; their model tokens were checked end to end by `check`
    (`sync/fresh_gap_max`), the observations out of it."""
    rows = list(steps.values())
    assert sum(row.get("episode/episodes", 0) for row in rows) == trained, rows
    assert sum(row.get(k, 0) for row in rows for k in ("episode/ends_error", "episode/ends_timeout")) == 0, rows
    assert any(row.get("episode/turns", 0) > 1 for row in rows), rows
    assert sum(row["sync/fresh_tokens"] for row in rows) > 0, rows


def train_killing_rollout(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """`train`, SIGKILLing one rollout Workhorse once the run has logged step 1; (the finished
    run, the pid killed)."""
    import psutil

    run_dir = Path(args[args.index("--output-dir") + 1])
    p = subprocess.Popen([sys.executable, "-m", "xray.train", "ppo", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    killed, deadline = 0, time.monotonic() + 600
    while not killed and p.poll() is None and time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip():
            rollouts = [q for q in psutil.process_iter(["cmdline"])
                        if (q.info["cmdline"] or [""])[0].startswith("ray::RolloutWorkhorse")]
            if rollouts:
                killed = rollouts[0].pid
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-6000:]
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), killed


def check_nothing_lost(checkpoint: Path, cfg: dict) -> int:
    """Prompts drawn from the sampler by step 3 = trained + buffered + in the making; the buffered count."""
    import json

    sampler = json.loads((checkpoint / "trainer_state.json").read_text())["sampler"]
    per_epoch = sampler["size"] // sampler["batch_size"] * sampler["batch_size"]
    drawn = sampler["epoch"] * per_epoch + sampler["position"]
    saved = torch.load(checkpoint / "async.pt", weights_only=False)
    buffered = sum(len(e["batch"]) for e in saved["entries"]) // cfg["rollout"]["n_samples"]
    step = int(checkpoint.name.split("-")[1])
    assert drawn == step * cfg["ppo"]["rollout_batch_size"] + buffered + len(saved["rows"]), \
        (drawn, buffered, saved["rows"])
    return len(saved["entries"])


def both_makers_fed(steps: dict[int, dict]) -> None:
    """Each of the two makers' groups reached the one trainer during the run."""
    made = [sum(row[f"async/trainer0_from_maker{i}"] for row in steps.values()) for i in range(2)]
    assert all(made), (made, steps)


def check_sigterm_then_resume(run: Path, path: Path, cfg: dict, backend: str) -> None:
    """SIGTERM to the driver once step 2 is logged: it exits 0 within 15 s with the resume command,
    its last checkpoint holds every prompt drawn, and `--resume` completes the run with every step
    logged once."""
    sigterm_once_logged(run, backend, path, 2)
    stopped_at = sorted(metrics(run))
    latest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert int(latest.name.split("-")[1]) == stopped_at[-1] < 6, (latest, stopped_at)
    check_nothing_lost(latest, cfg)
    train("--backend", backend, "--config", str(path), "--resume", str(run))
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6], logged  # nothing run twice, nothing skipped
    both_makers_fed(metrics(run))  # no maker lost in this run: both fed the trainer over its six steps


@pytest.mark.parametrize("trainers, backend", [  # each shape and each pair once with a resume
    (1, "megatron-vllm"), (2, "deepspeed-dsinfer")])
def test_two_makers_six_steps_and_resume(tmp_path, tiny_model, backend, trainers, request):
    from safetensors.torch import load_file

    episodes = (trainers, backend) == (1, "megatron-vllm")  # the makers play multi-turn episodes
    teacher = request.getfixturevalue("tiny_teacher") if (trainers, backend) == (2, "deepspeed-dsinfer") else None
    path = async_config(tmp_path, tiny_model, backend, trainers, ANSWER_GUESS if episodes else None, teacher)
    cfg = yaml.safe_load(path.read_text())
    run_a = tmp_path / "a"
    # a maker's rollout Workhorse lost once step 1 is logged: that maker replaced, the other and the
    # trainer going on, its queued groups still trained on (the buffer owns them: none lost)
    out, killed = train_killing_rollout("--backend", backend, "--config", str(path), "--output-dir", str(run_a))
    assert killed and "experience maker" in out.stderr and "replaced in" in out.stderr, out.stderr[-4000:]
    assert "the trainer and the other makers went on" in out.stderr
    logged = [json.loads(line)["step"] for line in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # no step run again: the counter never went back
    lines = [line for line in out.stdout.splitlines() if line.strip()]  # no worker-death text from Ray
    assert len(lines) == 1 and re.fullmatch(r"eval_before=\S+ eval_after=\S+", lines[0]), out.stdout[-3000:]
    assert max(row["async/requeued_lost"] for row in metrics(run_a).values()) == 0
    assert "eval_before=" in out.stdout and "eval_after=" in out.stdout
    check(metrics(run_a), [1, 2, 3, 4, 5, 6], trainers, backend, killed=True)
    assert all(("distill/reverse_kl" in r) == (teacher is not None) for r in metrics(run_a).values())  # makers scored
    if episodes:
        check_episodes(metrics(run_a), 6 * cfg["ppo"]["rollout_batch_size"] * cfg["rollout"]["n_samples"])
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(run_a / "final/actor/model.safetensors"))
    assert max(float((before[k] - after[k]).abs().max()) for k in before) > 0
    entries = check_nothing_lost(run_a / "checkpoints/step-000003", cfg)
    if (trainers, backend) == (1, "megatron-vllm"):  # the resume after a SIGTERM to the driver
        return check_sigterm_then_resume(tmp_path / "c", path, cfg, backend)
    run_b = tmp_path / "b"  # resume from the step-3 checkpoint: steps 4-6 run again
    (run_b / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_a / "checkpoints/step-000003", run_b / "checkpoints/step-000003")
    out = train("--backend", backend, "--config", str(path), "--resume", str(run_b))
    assert f"async: {entries} buffered experience groups" in out.stderr
    check(metrics(run_b), [4, 5, 6], trainers, backend)
