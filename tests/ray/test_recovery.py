"""A synchronous PPO run survives losing Workhorses: the dead model is replaced and the run goes on,
with the numbers of the same run uninterrupted.

In one 10-step run per backend pair (the e2e tier's tiny model and layout, a snapshot in memory
after every step, checkpoints on disk every 3), a training Workhorse's process is SIGKILLed at a
random moment of step 5, from its start (while step 4's snapshot is being taken and step 3's
checkpoint may still be written) to well into it (the actor's on megatron-vllm, the critic's on
deepspeed-dsinfer, slow tier): the run replaces that model, goes back to the newest complete
in-memory snapshot (step 4's, or step 3's when step 4's was cut) and finishes, having run again at
most one step that had finished. On megatron-vllm a rollout Workhorse is also killed during step 8:
it is replaced and step 8 runs again without going back (steps 6 and 7 ran once); and a critic
Workhorse gets SIGTERM during step 9: it is replaced when the step ends (or the next, when the
notice reaches the run after the step's end), from that step's snapshot, and no step runs again. The megatron-vllm run keeps a warm standby process per model
(`trainer.standby_workhorses: 1`): the actor's and the critic's replacements are built in them.
The killed model's other shard (rank 1) is no new process: it rebuilds in its own and rejoins.
Each such run is compared with the same run uninterrupted (run once per backend pair and module,
`uninterrupted`): every step's metrics (time aside) and the exported actor are equal, bit for bit.
An asynchronous run whose trainer is lost (slow tier) goes back to its checkpoint, restored from memory.
A run that fails for good writes its newest snapshot in memory as a checkpoint (save at
breakpoint), synchronous and asynchronous.
"""
import asyncio
import collections
import json
import logging
import os
import random
import re
import signal
import time

import pytest
import yaml

from tests.e2e.test_ppo_e2e import config

pytestmark = pytest.mark.ray


def writing(run) -> bool:
    """Whether the run's newest checkpoint is still being written (its trainer state comes last)."""
    newest = max(run.checkpoints.glob("step-*"), default=None)
    return newest is not None and not (newest / "trainer_state.json").exists()


async def kill_during(trainer, run, kills: list[tuple], done: list, begun: list[int], quiet: bool = False) -> None:
    """SIGKILL each (step, role, pid, delay[, signal]) `delay` seconds after the step before it
    ended, or (`delay` None) once the step has begun, past its boundary's reading of drain notices
    (or send it `signal`). With
    `quiet`, only once no checkpoint is being written: the asynchronous run goes back to the last
    one, not to one that a kill racing its write abandons (a tiny model's async step, ~0.17 s, is
    about as long as a write)."""
    for step, role, pid, delay, *sig in kills:
        while trainer.state.step < step - 1 or (quiet and writing(run)) or (delay is None and step not in begun):
            await asyncio.sleep(0.002)
        await asyncio.sleep(delay or 0.0)
        sig = sig[0] if sig else signal.SIGKILL
        logging.getLogger(__name__).warning("sending %s to the %s Workhorse pid %d %.2f s after step %d ended "
                                            "(checkpoint being written: %s)", sig.name, role, pid, delay or 0.0, step - 1,
                                            writing(run))
        os.kill(pid, sig)
        done.append((role, trainer.state.step))


def train_with_kills(trainer, run, data, kills: list[tuple], quiet: bool = False, pad_s: float = 0.0
                     ) -> tuple[float, list[tuple[str, int]]]:
    """The run's `train` with `kill_during` beside it: (eval after, [(role killed, steps finished then)]).
    `pad_s`: every step lasts that much longer after its work (as a step with more to do would)."""
    from xray.run.loop import train

    killed: list[tuple[str, int]] = []
    begun: list[int] = []
    step = trainer.step

    async def padded(*args, **kwargs):
        metrics = await step(*args, **kwargs)
        await asyncio.sleep(pad_s)
        return metrics

    def counted(*args, **kwargs):  # the step's coroutine, created once the boundary before it is done
        begun.append(trainer.state.step + 1)
        return padded(*args, **kwargs) if pad_s else step(*args, **kwargs)

    async def main() -> float:
        trainer.step = counted
        killer = asyncio.ensure_future(kill_during(trainer, run, kills, killed, begun, quiet))
        try:
            return await train(trainer, run, data, None)
        finally:
            killer.cancel()
            del trainer.step
    return asyncio.run(main()), killed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model, local_ray):
    """`uninterrupted(backend)`: the RunDir of the tests' 10-step run (the e2e tier's tiny model and
    layout, checkpoints every 3 steps) uninterrupted, run once a module per backend pair: the
    faulted runs' numbers must equal its (a run's step metrics do not depend on its length, its
    checkpoints or its standby processes: the schedule is constant)."""
    from algorithms.rl import rl_trainer
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    runs: dict = {}

    def get(backend: str):
        if backend not in runs:
            root = tmp_path_factory.mktemp(f"uninterrupted-{backend}")
            path = config(root, tiny_model, backend)
            _, cfg, plan, _, _ = resolve(["ppo", "--backend", backend, "--config", str(path), "--trainer.steps=10",
                                          "--trainer.save_every=3"])
            runs[backend] = RunDir(root / "whole")
            with rl_trainer(cfg, plan, runs[backend]) as (trainer, data):
                asyncio.run(train(trainer, runs[backend], data, None))
        return runs[backend]
    return get


def steps_logged(run) -> collections.Counter:
    """How many times each step's metrics were written (a step run again is written again)."""
    return collections.Counter(json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("backend, trained", [  # deepspeed-dsinfer in the slow tier: the default tier's budget
    ("megatron-vllm", "actor"), pytest.param("deepspeed-dsinfer", "critic", marks=pytest.mark.slow)])
def test_dead_workhorses_are_replaced(tmp_path, tiny_model, backend, trained, caplog, uninterrupted):
    import ray
    import torch
    from safetensors.torch import load_file

    from algorithms.rl import rl_trainer
    from tests.e2e.test_ppo_e2e import metrics, stable
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = config(tmp_path, tiny_model, backend)
    standby = int(trained == "actor")  # the megatron run keeps a warm standby process per model (docs/runs.md)
    aborting = trained == "critic"  # the actor told to drain with a 0.8 s grace at step 8's start: that step aborted
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", backend, "--config", str(path), "--trainer.steps=10",
                                  "--trainer.save_every=3", f"--trainer.standby_workhorses={standby}",
                                  *(["--trainer.drain_grace_s=0.8", "--trainer.max_restarts=1"] if aborting else [])])
    whole = uninterrupted(backend)  # the same run, uninterrupted: the faulted one's numbers must equal it
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    delay = random.uniform(0.0, 1.0)  # a step of this run takes about 1.5 s
    with rl_trainer(cfg, plan, run) as (trainer, data):
        pid = {role: ray.get(getattr(trainer.models, role).shard_handles()[0].pid.remote())
               for role in (trained, "rollout", "critic", "actor")}
        survivor = ray.get(getattr(trainer.models, trained).shard_handles()[1].pid.remote())  # rank 1: kept
        deadline = time.monotonic() + 120
        while standby and not trainer.models.keep_standby(check=True):
            assert time.monotonic() < deadline, "the standby processes never warmed"
            time.sleep(0.2)
        warm = {role: set(ray.get(getattr(trainer.models, role)._actor.standby_pids.remote()))
                for role in (trained, "critic")}
        kills = [(5, trained, pid[trained], delay)]
        if trained == "actor":  # the rollout lost in step 8; the critic told to drain during step 9
            kills += [(8, "rollout", pid["rollout"], 0.0), (9, "critic", pid["critic"], 0.3, signal.SIGTERM)]
        if aborting:  # once step 8 has begun (past step 7's reading of notices): seen 0.2-0.4 s in (the inbox is
            # read every 0.2 s), the rest of a step padded by 0.5 s (1.1 s on a fast host, 2 s on a slow one) outlasts
            # half the 0.8 s grace on any host, so the step is aborted (unpadded, a fast CI host's 0.6 s step was not)
            kills += [(8, "actor", pid["actor"], None, signal.SIGTERM)]
        _, killed = train_with_kills(trainer, run, data, kills, pad_s=0.5 if aborting else 0.0)
        now = {role: {p["pid"] for p in getattr(trainer.models, role).ping().get()} for role in warm}
        model = getattr(trainer.models, trained)  # its rank 0 killed: rank 1 rebuilt in its own process
        assert ray.get(model.shard_handles()[1].pid.remote()) == survivor
        assert ray.get(model._actor.last_rejoined.remote()) == [1]
    if standby:  # the replacements (the killed actor, the drained critic) were built in the warm standbys
        assert all(len(warm[role]) == 1 and warm[role] <= now[role] for role in warm), (warm, now)
    assert [role for role, _ in killed] == [k[1] for k in kills] and trainer.state.step == 10
    finished = killed[0][1]  # steps finished when the trained Workhorse was killed (4, or 5 after a long delay)
    rows = steps_logged(run)
    assert sorted(rows) == list(range(1, 11))
    log = caplog.text
    back = re.search(r"back at step (\d+), restored from the in-memory snapshot", log)
    assert back and int(back.group(1)) in (finished - 1, finished), (delay, finished, log[-3000:])  # or its snapshot was cut
    # at most one finished step ran again: the one after the snapshot restored (a step may still end after
    # the kill when the dead shard's part of it was done, and its snapshot is then the one cut)
    redone = {step: n - 1 for step, n in rows.items() if n > 1}
    assert set(redone) <= {int(back.group(1)) + 1} and max(redone.values(), default=1) == 1, (delay, rows)
    # recovered by numbers: every step (as last logged) and the exported actor equal the uninterrupted run's
    faulted, uninterrupted = metrics(run.path), metrics(whole.path)
    for step in range(1, 11):
        assert stable(faulted[step]) == stable(uninterrupted[step]), (step, faulted[step], uninterrupted[step])
    a, b = (load_file(str(next((r.path / "final/actor").glob("*.safetensors")))) for r in (run, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert f"{trained}: replaced" in log
    if aborting:  # the step would outlast half the 0.8 s grace: aborted at once, the actor replaced, every
        # trained model back at step 7's snapshot, step 8 run again (once logged) and no restart charged (max 1)
        aborted = re.search(r"step aborted ([\d.]+) s in \(expected ([\d.]+) s\)", log)
        assert aborted and float(aborted.group(1)) < 1.0, log[-3000:]
        assert "replacing actor having aborted step 8" in log, log[-3000:]
        assert re.search(r"actor replaced after a drain notice in [\d.]+ s; at step 7, restored from the in-memory", log)
        assert "Workhorses died ({'actor'" not in log
    assert ("rollout: replaced" in log) == (trained == "actor")
    if trained == "actor":  # the drained critic: replaced after step 9 from its snapshot, nothing run again (or
        # after step 10 when its notice reached the inbox only after step 9 ended: seen once on a busy host, the
        # SIGTERM 0.3 s into a step and its notice later than the step's end)
        drained = re.search(r"drain notice \(SIGTERM\) from critic rank 0 \(pid \d+\); replacing critic after step (\d+)", log)
        assert drained and drained.group(1) in ("9", "10"), log[-3000:]
        assert "critic replaced after a drain notice" in log
        assert f"at step {drained.group(1)}, restored from the in-memory snapshot" in log


@pytest.mark.slow
def test_async_run_recovers(tmp_path, tiny_model, caplog, local_ray):
    """An asynchronous run (one trainer, two makers) whose actor Workhorse is killed during step 5
    (and whose rollout and critic Workhorses are told to drain in steps 3 and 6, checked below):
    the actor is replaced and the trainer restores the newest snapshot in memory (step 4, or 3 when
    the kill cut step 4's copy) while the makers and the buffer go on; at most that one step runs
    again, on the groups it had taken (given back to the buffer: its prompts are not skipped), and the
    run finishes (a lost maker is replaced without going back: tests/e2e/test_async_e2e.py)."""
    import ray

    from algorithms.rl import rl_trainer
    from tests.e2e.test_async_e2e import async_config, check_nothing_lost
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = async_config(tmp_path, tiny_model, "megatron-vllm", 1)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "megatron-vllm", "--config", str(path), "--trainer.steps=8",
                                  "--trainer.max_restarts=1"])  # the kill's; the drains take none
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    with rl_trainer(cfg, plan, run) as (trainer, data):
        pid = {role: ray.get(getattr(trainer.models, role).shard_handles()[0].pid.remote())
               for role in ("actor", "critic", "rollout")}
        kills = [(3, "rollout", pid["rollout"], 0.0, signal.SIGTERM), (5, "actor", pid["actor"], 0.0),
                 (6, "critic", pid["critic"], 0.1, signal.SIGTERM)]  # steps after it: the last push is loaded
        _, killed = train_with_kills(trainer, run, data, kills, quiet=True)
    assert [role for role, _ in killed] == ["rollout", "actor", "critic"] and trainer.state.step == 8
    last = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 8 and last["sync/version"] == 7  # the makers took the trainer's pushes
    rows = steps_logged(run)
    assert sorted(rows) == list(range(1, 9))
    assert all(rows[s] == 1 for s in (1, 2, 3)) and max(rows.values()) <= 2 and sum(rows.values()) <= 9, rows
    log = caplog.text
    assert "actor: replaced" in log
    back = re.search(r"the trainer is back at step (\d+), restored from the in-memory snapshot .*the makers and the "
                     r"buffer went on", log)
    assert back and int(back.group(1)) in (3, 4), log[-3000:]
    assert "async run back at the checkpoint" not in log  # no rollback to the disk, no new buffer
    lost = re.search(r"the groups of (\d+) lost steps? given back to the buffer", log)
    assert lost and 1 <= int(lost.group(1)) <= 2, log[-3000:]  # the step in flight, and the one before when
    # its snapshot was cut
    # the lost step's prompts trained, not skipped: every prompt drawn by step 6 is trained, queued
    # or being made (a skipped step would have drawn rollout_batch_size prompts more)
    check_nothing_lost(run.path / "checkpoints/step-000006", yaml.safe_load(path.read_text()))
    # drains (SIGTERM): the maker's replica restarted at once, the critic replaced once the trainer finished its
    # step, from that step's snapshot (no step run again), neither charged to max_restarts (1, the kill's)
    assert "drain notice (SIGTERM) from rollout rank 0" in log and "experience maker 0 replaced after a drain" in log
    drained = re.search(r"critic replaced after a drain notice in [\d.]+ s; the trainer is at step (\d+), restored "
                        r"from the in-memory snapshot", log)
    assert drained and int(drained.group(1)) >= 5, log[-3000:]
    assert all(rows[s] == 1 for s in range(int(drained.group(1)), 9)), rows
    assert "experience maker 0 failed" not in log and "critic: replaced" in log


def fails_after_actor_kill(cfg, plan, run, step: int, match: str):
    """Run with the actor's first Workhorse SIGKILLed as `step` begins and no restart budget: the
    run fails (its error matching `match`); the latest complete checkpoint then (save at breakpoint)."""
    import ray

    from algorithms.rl import rl_trainer

    with rl_trainer(cfg, plan, run) as (trainer, data):
        kills = [(step, "actor", ray.get(trainer.models.actor.shard_handles()[0].pid.remote()), 0.0)]
        with pytest.raises(Exception, match=match):
            train_with_kills(trainer, run, data, kills)
    return run.latest_checkpoint()


def test_a_fatal_failure_saves_its_newest_snapshot_and_the_resume_is_exact(tmp_path, tiny_model, caplog,
                                                                           uninterrupted):
    """Save at breakpoint (xray/run/breakpoint.py): a 3-step megatron-vllm run with no checkpoint on
    disk (`save_every: 0`) and no restart budget loses its actor Workhorse as step 3 begins and
    fails; its newest snapshot in memory (step 2's, or step 1's when the kill cut step 2's copy)
    is then on disk as a complete checkpoint, and `--resume` from it gives the steps after it with
    the same metrics as an uninterrupted run of the same seed (the module's, 10 steps long)."""
    from algorithms.rl import rl_trainer
    from tests.e2e.test_ppo_e2e import metrics, stable
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = config(tmp_path, tiny_model, "megatron-vllm")
    args = ["ppo", "--backend", "megatron-vllm", "--config", str(path), "--trainer.save_every=0",
            "--trainer.max_restarts=0"]
    _, cfg, plan, _, _ = resolve(args)
    whole = uninterrupted("megatron-vllm")
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    saved = fails_after_actor_kill(cfg, plan, run, 3, "actor")
    assert saved is not None and saved.name in ("step-000001", "step-000002"), sorted(run.checkpoints.iterdir())
    assert f"save at breakpoint: the run failed; its newest snapshot in memory (step {int(saved.name[5:])})" in caplog.text
    with rl_trainer(cfg, plan, run) as (trainer, data):
        asyncio.run(train(trainer, run, data, str(run.path)))
    resumed, uninterrupted = metrics(run.path), metrics(whole.path)
    assert sorted(resumed) == [1, 2, 3] and trainer.state.step == 3
    probe = ("sync/max_abs_logprob_diff", "sync/mean_abs_logprob_diff")  # at a run's first and last syncs: its
    for step in range(int(saved.name[5:]) + 1, 4):  # placement is all that depends on the run's length
        assert {k: v for k, v in stable(resumed[step]).items() if k not in probe} == \
            {k: v for k, v in stable(uninterrupted[step]).items() if k not in probe}, step


def test_an_asynchronous_run_saves_its_trainers_newest_snapshot_at_a_fatal_failure(tmp_path, tiny_model, caplog,
                                                                                  local_ray):
    """Save at breakpoint, asynchronous (`Detached.save_at_breakpoint`): a 6-step megatron-vllm run
    (one trainer, two makers) with no checkpoint on disk and no restart budget loses its actor
    Workhorse after step 3 and fails; the trainer's newest snapshot in memory (step 3's, or 2's
    when the kill cut step 3's copy) is then a complete checkpoint whose buffer accounts for every
    prompt drawn (trained by its step, queued, or to be made again: the groups the trainer took
    since, and those sampled by its later versions, are back among them), and `--resume` from it
    finishes the run."""
    from algorithms.rl import rl_trainer
    from tests.e2e.test_async_e2e import async_config, check_nothing_lost
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = async_config(tmp_path, tiny_model, "megatron-vllm", 1)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "megatron-vllm", "--config", str(path),
                                  "--trainer.save_every=0", "--trainer.max_restarts=0"])
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    saved = fails_after_actor_kill(cfg, plan, run, 4, "max_restarts")
    assert saved is not None and saved.name in ("step-000002", "step-000003"), sorted(run.checkpoints.iterdir())
    assert (f"the trainer's newest snapshot in memory (step {int(saved.name[5:])}) is now the checkpoint"
            in caplog.text), caplog.text[-3000:]
    check_nothing_lost(saved, yaml.safe_load(path.read_text()))
    with rl_trainer(cfg, plan, run) as (trainer, data):
        asyncio.run(train(trainer, run, data, str(run.path)))
    assert trainer.state.step == 6 and sorted(steps_logged(run)) == list(range(1, 7))


async def kill_trainer_actor(trainer, step: int, killed: list) -> None:
    """SIGKILL the asynchronous run's trainer actor (`AsyncTrainer`, its own process) once step
    `step - 1` has ended."""
    import psutil

    while trainer.state.step < step - 1:
        await asyncio.sleep(0.002)
    found = [p for p in psutil.process_iter(["pid", "cmdline", "create_time"])
             if "AsyncTrainer" in " ".join(p.info["cmdline"] or [])]
    assert found, "no AsyncTrainer process"
    os.kill(max(found, key=lambda p: p.info["create_time"]).info["pid"], signal.SIGKILL)  # this run's
    killed.append(trainer.state.step)


def test_an_asynchronous_run_goes_on_when_its_trainer_actor_dies(tmp_path, tiny_model, caplog, local_ray):
    """The trainer actor itself (not a Workhorse: the process that runs the trainer's loop) is
    SIGKILLed once step 3 has ended: a new trainer actor takes over from the newest snapshot the
    trained Workhorses still hold of a step the driver saw end (step 3's, or 2's), the buffer gives
    back the groups the dead one had taken since (it keeps them), and the makers go on; the run
    finishes with every step logged, at most the lost ones again, and its last checkpoint accounts
    for every prompt drawn (none skipped)."""
    from algorithms.rl import rl_trainer
    from tests.e2e.test_async_e2e import async_config, check_nothing_lost
    from xray.run.loop import train
    from xray.run.outputs import RunDir
    from xray.train import resolve

    path = async_config(tmp_path, tiny_model, "megatron-vllm", 1)
    _, cfg, plan, _, _ = resolve(["ppo", "--backend", "megatron-vllm", "--config", str(path),
                                  "--trainer.max_restarts=1"])
    run = RunDir(tmp_path / "run")
    caplog.set_level(logging.WARNING)
    killed: list = []
    with rl_trainer(cfg, plan, run) as (trainer, data):
        async def main() -> float:
            killer = asyncio.ensure_future(kill_trainer_actor(trainer, 4, killed))
            try:
                return await train(trainer, run, data, None)
            finally:
                killer.cancel()
        asyncio.run(main())
    log = caplog.text
    assert killed and trainer.state.step == 6, (killed, log[-3000:])
    took = re.search(r"the trainer actor died \(\w+\); a new one took over at step (\d+) from the snapshot", log)
    assert took and int(took.group(1)) in (killed[0] - 1, killed[0]), log[-3000:]
    assert "async run back at the checkpoint" not in log  # no rollback to the disk, no new buffer
    rows = steps_logged(run)
    assert sorted(rows) == list(range(1, 7)) and max(rows.values()) <= 2 and sum(rows.values()) <= 8, rows
    check_nothing_lost(run.path / "checkpoints/step-000006", yaml.safe_load(path.read_text()))


class _Listening:
    """A process that listens for SIGTERM as a Workhorse does (xray/workhorse/drain.py)."""

    def __init__(self) -> None:
        from xray.workhorse.drain import listen

        listen("probe", 3)

    def pid(self) -> int:
        return os.getpid()


def test_a_drained_process_tells_the_run_and_serves_for_the_runs_grace(local_ray):
    """`trainer.drain_grace_s` reaches the Workhorses through the inbox: a SIGTERMed process posts its
    notice at once and exits that grace later, not 30 s (the default) and not at once."""
    import psutil
    import ray

    from xray.workhorse.drain import open_inbox

    inbox = open_inbox(grace_s=3.0)
    probe = ray.remote(num_cpus=0)(_Listening).remote()
    pid = ray.get(probe.pid.remote())
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert ray.get(probe.pid.remote()) == pid  # still serving (a call runs the Python handler too)
    notices = []
    while not notices and time.monotonic() - t0 < 10:
        notices = ray.get(inbox.take.remote())
        time.sleep(0.05)
    assert notices == [("probe", 3, pid)] and time.monotonic() - t0 < 2.0
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    gone = time.monotonic() - t0
    assert 2.5 <= gone <= 6.0, gone  # the run's 3 s (its process' exit takes a moment)
    open_inbox(grace_s=30.0)  # as the next run finds it
