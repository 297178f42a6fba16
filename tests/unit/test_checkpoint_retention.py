"""`trainer.keep_last`: a run keeps its newest complete checkpoints on disk and deletes the older.

The rule on directories (`RunDir.prune_checkpoints`): the newest `keep_last` complete ones stay,
and so do those not complete yet (being written, or abandoned) and those asked to be kept; 0 keeps
all; steps order by number, not by name. Its wiring: completing a checkpoint in
`FlashCheckpoints` prunes with the `keep_last` its `take` was given. The config's field checks
its value. (An e2e run keeps 2 of its 3: tests/e2e/test_ppo_e2e.py.)
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def _checkpoints(run, steps, incomplete=()):
    for step in (*steps, *incomplete):
        d = run.checkpoint_dir(step)
        (d / "actor").mkdir(parents=True)
        (d / "actor/rank00000.pt").write_bytes(b"x" * 10)
        if step not in incomplete:
            run.write_trainer_state(d, {"step": step})


def _names(run) -> list[str]:
    return sorted(p.name for p in run.checkpoints.iterdir())


def test_the_newest_complete_checkpoints_stay_and_nothing_unfinished_is_deleted(tmp_path):
    from xray.run.outputs import RunDir

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    _checkpoints(run, [1, 2, 3, 4, 5], incomplete=[6])
    assert run.prune_checkpoints(0) == [] and len(_names(run)) == 6  # 0: keep all
    removed = run.prune_checkpoints(2, keep=(run.checkpoint_dir(2),))
    assert [p.name for p in removed] == ["step-000001", "step-000003"]
    assert _names(run) == ["step-000002", "step-000004", "step-000005", "step-000006"]
    assert run.latest_checkpoint() == run.checkpoint_dir(5)
    run.prune_checkpoints(1)  # the newest complete one stays, and the one being written
    assert _names(run) == ["step-000005", "step-000006"]
    assert run.latest_checkpoint() == run.checkpoint_dir(5)


def test_steps_order_by_number(tmp_path):
    from xray.run.outputs import RunDir

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    _checkpoints(run, [999_999, 1_000_000, 20])
    assert run.latest_checkpoint().name == "step-1000000"
    assert [p.name for p in run.prune_checkpoints(1)] == ["step-000020", "step-999999"]


def test_completing_a_checkpoint_prunes_with_its_keep_last(tmp_path):
    from xray.run.checkpoints import FlashCheckpoints, _Writing
    from xray.run.outputs import RunDir

    run = RunDir(tmp_path / "run", loggers=("jsonl",))
    checkpoints = FlashCheckpoints(run, models=None, roles=())

    async def complete(step: int, keep_last: int) -> None:
        done = asyncio.get_running_loop().create_future()
        done.set_result([])
        d = run.checkpoint_dir(step)
        (d / "actor").mkdir(parents=True)
        checkpoints.writing = _Writing(d, {"step": step}, done, done, time.perf_counter(), keep_last)
        checkpoints._complete()

    async def steps() -> None:
        for step in (1, 2, 3):
            await complete(step, keep_last=2)
        assert _names(run) == ["step-000002", "step-000003"]
        await complete(4, keep_last=0)
        assert _names(run) == ["step-000002", "step-000003", "step-000004"]
        await complete(5, keep_last=1)
        assert _names(run) == ["step-000005"]

    asyncio.run(steps())
    assert json.loads((run.checkpoint_dir(5) / "trainer_state.json").read_text()) == {"step": 5}


def test_keep_last_defaults_to_3_and_refuses_a_negative_count():
    from xray.config import ConfigError, load_config
    from xray.config.schema import TrainerConfig

    assert TrainerConfig().keep_last == 3
    root = Path(__file__).resolve().parents[2]
    assert load_config(root / "configs/ppo_tiny_cpu.yaml", ["--trainer.keep_last=0"]).trainer.keep_last == 0
    with pytest.raises(ConfigError, match=r"trainer.keep_last=-1 is negative; give 0 \(keep every checkpoint\)"):
        load_config(root / "configs/ppo_tiny_cpu.yaml", ["--trainer.keep_last=-1"])
