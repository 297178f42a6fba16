"""Save at breakpoint: a run that fails for good writes its newest snapshot in memory to the disk.

Sits beside the flash checkpoints (`xray/run/checkpoints.py`). A synchronous run keeps a snapshot
of every step in memory (`trainer.memory_snapshots`) but writes one to the disk only every
`trainer.save_every` steps; when the run then fails beyond recovery (its restart budget spent, or
an error no recovery handles), the steps since the last checkpoint on disk would be lost with the
process. `save_at_breakpoint` writes that newest complete snapshot as the checkpoint of its step,
from the copies the object store keeps (each shard's `hand_snapshot` answer outlives its
Workhorse): a Ray task per shard writes its files where its Workhorse would have, then the
trainer's state of the same instant marks the checkpoint complete, so `--resume` goes on from it.
An asynchronous run's trainer keeps its snapshots itself: it writes the newest the same way
(`AsyncTrainer.breakpoint`) and the driver adds the buffer's state brought back to that step
(`save_async_at_breakpoint`) before the run's actors stop, whenever the detached run ends in
an error: a recovery that goes back to the disk (`recover_async`) then starts from it too.
DLRover's `--save_at_breakpoint` does this for a torch job's flash checkpoint.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from xray.run.checkpoints import FlashCheckpoints, Held
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)


def write_held(held: dict[str, Any]) -> int:
    """Write one shard's snapshot files (`file_key` path -> object: a marker as text, the rest as
    `torch.save` writes them, atomically) where they belong; returns how many."""
    from xray.backends.snapshot import from_wire, write_atomically

    for path, value in held.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(value, str):
            with open(path, "w") as f:
                f.write(value)
        else:
            write_atomically(from_wire(value), path)
    return len(held)


async def write_snapshot(held: Held) -> None:
    """Write every shard's files of the snapshot `held` where its Workhorse would have, one Ray
    task per shard reading the copy the object store keeps (the trainer's state is the caller's:
    written last, it marks the checkpoint complete)."""
    import ray

    task = ray.remote(num_cpus=0)(write_held)
    refs = [ref for _, shard_refs in held.roles.values() for ref in shard_refs]
    await asyncio.gather(*[task.remote(ref) for ref in refs])


def newer_than_disk(held: Held | None, run: RunDir) -> bool:
    """Whether the snapshot `held` is of a later step than the latest complete checkpoint on disk."""
    latest = run.latest_checkpoint()
    return held is not None and (latest is None or int(latest.name.split("-")[1]) < held.step)


async def save_at_breakpoint(checkpoints: FlashCheckpoints, run: RunDir) -> Path | None:
    """Write the newest complete snapshot in memory as a checkpoint if it is newer than the latest
    on disk; its directory, or None when there is nothing newer (or it cannot be written: logged)."""
    held = checkpoints.restorable()
    if not newer_than_disk(held, run):
        return None
    try:
        await checkpoints.materialize(held.directory)  # files some ranks kept in their process
        await write_snapshot(held)
        run.write_trainer_state(held.directory, held.trainer_state)
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
        log.warning("save at breakpoint: the snapshot of step %d could not be written (%s); the latest "
                    "checkpoint on disk stays %s", held.step, str(exc).splitlines()[0] if str(exc) else exc,
                    run.latest_checkpoint())
        return None
    log.warning("save at breakpoint: the run failed; its newest snapshot in memory (step %d) is now the "
                "checkpoint %s (resume with --resume)", held.step, held.directory)
    return held.directory


async def save_async_at_breakpoint(detached) -> str | None:
    """An asynchronous run's `Detached` (`xray/run/detached/supervisor.py`) ends in an error: stop
    its makers (their prompts queued again), have its trainer write its newest snapshot in memory as
    a checkpoint when newer than the latest on disk (`AsyncTrainer.breakpoint`, which brings the
    buffer back to its step), then write the buffer's snapshot and the trainer's state beside it
    (the latter marks it complete), as `xray.run.resume.save_checkpoint` would have at that step.
    Its directory; None when there is nothing newer or it cannot be written (logged: the run's
    error is the one raised)."""
    from xray.backends.snapshot import write_atomically
    from xray.run.resume import ASYNC_STATE

    if detached.run_path is None or detached.learner is None:
        return None
    run = RunDir(Path(detached.run_path))
    latest = run.latest_checkpoint()
    try:
        await detached.stop_makers(list(range(len(detached.makers))))
        saved = await detached.learner.breakpoint.remote(int(latest.name.split("-")[1]) if latest else -1)
        if saved is None:
            return None
        snapshot = await detached.state_dict()
        sampler, directory = snapshot.pop("sampler"), Path(saved["directory"])
        await asyncio.to_thread(write_atomically, snapshot, str(directory / ASYNC_STATE))
        run.write_trainer_state(directory, {"step": saved["step"], "kl": saved["kl"], "sampler": sampler,
                                            "eval_before": detached.trainer.state.eval_before,
                                            "model_dir": detached.data.model_dir})
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
        log.warning("save at breakpoint: the trainer's newest snapshot could not be written (%s); the latest "
                    "checkpoint on disk stays %s", str(exc).splitlines()[0] if str(exc) else exc, latest)
        return None
    log.warning("save at breakpoint: the asynchronous run failed; the trainer's newest snapshot in memory "
                "(step %d) is now the checkpoint %s, with the buffer as at that step", saved["step"], directory)
    return str(directory)
