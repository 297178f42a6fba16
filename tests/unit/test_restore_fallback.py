"""A recovery whose newest snapshot in memory cannot be read restores the one before, not the disk.

A node that leaves while a step's snapshot is being pinned on another node loses that snapshot's
shards on it, while the snapshot before (the checkpoint still being written, held in memory)
stays whole on the survivors: `back_to_checkpoint` tries the snapshots memory holds newest first
(`FlashCheckpoints.restorables`) and goes to the latest checkpoint on disk only when none can be
read, so one lost node costs the step in flight and the one whose snapshot was lost, not every
step since the last checkpoint on disk (CI saw steps 3 to 5 run again when only 5 had to).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def _held(checkpoints, run, step: int):
    from xray.run.checkpoints import Held

    d = run.checkpoint_dir(step)
    held = checkpoints._held[d] = Held(step, d, {"actor": ("layout", [f"ref{step}"])}, {"step": step}, {"actor": (["node"], [f"copy{step}"])})
    return held


def _run_with_snapshots(tmp_path, on_disk: int | None):
    from xray.run.checkpoints import FlashCheckpoints
    from xray.run.outputs import RunDir

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    if on_disk is not None:
        run.checkpoint_dir(on_disk).mkdir(parents=True)
        run.write_trainer_state(run.checkpoint_dir(on_disk), {"step": on_disk})
    checkpoints = FlashCheckpoints(run, models=None, roles=("actor",))
    for step in (2, 4, 5):
        _held(checkpoints, run, step)
    checkpoints.in_memory = checkpoints._held[run.checkpoint_dir(5)]
    return run, checkpoints


def _recover(monkeypatch, run, checkpoints, unreadable: set[int]) -> tuple[str, list[int]]:
    import xray.run.resume
    from xray.run.recovery.recover import back_to_checkpoint

    tried: list[int] = []

    async def resume_from(trainer, directory, data, detached=None, checkpoints=None, state=None):
        step = int(Path(directory).name.split("-")[1])
        tried.append(step)
        if step in unreadable and state is not None:  # the disk's checkpoint (no state given) reads
            raise RuntimeError(f"ObjectLostError: the files of step {step} were lost with their node")
        return "memory"

    monkeypatch.setattr(xray.run.resume, "resume_from", resume_from)
    source = asyncio.run(back_to_checkpoint(RuntimeError("a Workhorse died"), None, None, run, {"actor": [1]},
                                            checkpoints))
    return source, tried


def test_the_newest_unreadable_snapshot_falls_back_to_the_one_before_in_memory(tmp_path, monkeypatch, caplog):
    run, checkpoints = _run_with_snapshots(tmp_path, on_disk=2)
    assert [h.step for h in checkpoints.restorables()] == [5, 4, 2]
    source, tried = _recover(monkeypatch, run, checkpoints, unreadable={5})
    assert (source, tried) == ("the in-memory snapshot (replicated)", [5, 4])
    assert "the in-memory snapshot of step 5 cannot be read (ObjectLostError" in caplog.text


def test_no_older_snapshot_than_the_disk_is_tried_and_the_disk_is_the_last_resort(tmp_path, monkeypatch):
    run, checkpoints = _run_with_snapshots(tmp_path, on_disk=4)
    source, tried = _recover(monkeypatch, run, checkpoints, unreadable={5, 4})
    assert tried == [5, 4, 4] and source == "memory"  # then the checkpoint of step 4 on disk, not step 2's snapshot


def test_a_snapshot_newer_than_the_complete_one_is_not_restored(tmp_path, monkeypatch):
    run, checkpoints = _run_with_snapshots(tmp_path, on_disk=None)
    _held(checkpoints, run, 6)  # being taken, not complete: never the run's in_memory
    assert [h.step for h in checkpoints.restorables()] == [5, 4, 2]
    _, tried = _recover(monkeypatch, run, checkpoints, unreadable={5, 4})
    assert tried == [5, 4, 2]
