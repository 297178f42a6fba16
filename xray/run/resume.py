"""Checkpoints of an RL run (synchronous or asynchronous): taking one, and resuming from one.

`save_checkpoint` takes a flash checkpoint of the trained roles with the trainer's state and, in
an asynchronous run, the buffer's snapshot (`xray.run.detached.supervisor`); `resume_from` restores a
run from one (the run, `xray.run.loop`, and the recovery, `xray.run.recovery.recover`, use it).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from xray.run.step import RLTrainer, RunState
from xray.run.checkpoints import FlashCheckpoints
from xray.run.inputs import RunData
from xray.run.outputs import read_trainer_state

log = logging.getLogger(__name__)
ASYNC_STATE = "async.pt"
"""An async run's checkpoint file for the buffer's experiences and the prompts in the making."""


async def save_checkpoint(trainer: RLTrainer, checkpoints: FlashCheckpoints, data: RunData,
                          detached=None, persist: bool = True) -> asyncio.Future:
    """A flash checkpoint of the actor and critic, with the trainer's state and, in async mode, the
    buffer's experiences and the prompts of batches in the making (`Detached.state_dict`); returns
    a future of the seconds training stopped for it (`FlashCheckpoints.take`: not waited for here).
    Without `persist`, a snapshot kept in memory only (synchronous runs, every step). Once it is
    on disk, older checkpoints beyond `trainer.keep_last` are deleted."""
    if detached is not None:  # the buffer's snapshot holds the sampler's state of the same instant
        snapshot = await detached.state_dict()
        sampler, files = snapshot.pop("sampler"), {ASYNC_STATE: snapshot}
    else:
        sampler, files = data.sampler.state_dict(), {}
    state = {"step": trainer.state.step, "kl": trainer.kl.state_dict(), "eval_before": trainer.state.eval_before,
             "sampler": sampler, "model_dir": data.model_dir}  # model_dir: what `python -m xray.export` copies from
    return await checkpoints.take(trainer.state.step, state, files, persist, trainer.cfg.trainer.keep_last)


async def resume_from(trainer: RLTrainer, directory: Path, data: RunData, detached=None,
                      checkpoints: FlashCheckpoints | None = None, state: dict | None = None) -> str:
    """Restore the run from checkpoint `directory` (the models from the snapshots `checkpoints`
    holds in memory, in any layout; `state`: the trainer's state of an in-memory
    snapshot that never reached the disk); returns where the models' files came from."""
    state = state if state is not None else read_trainer_state(directory)
    models = trainer.models
    if checkpoints is not None:
        await checkpoints.materialize(directory)  # files some ranks kept in their process, handed now
    held = {role: checkpoints.held_for(directory, role) if checkpoints else None for role in trainer.trained}
    sources = await asyncio.gather(*[getattr(models, role).load(str(directory / role), **(held[role] or {}))
                                     for role in trainer.trained])
    trainer.kl.load_state_dict(state["kl"])
    data.sampler.load_state_dict(state["sampler"])
    trainer.state = RunState(step=state["step"], kl=state["kl"], eval_before=state["eval_before"])
    if checkpoints is not None:
        checkpoints.forget_after(trainer.state.step)
        checkpoints.placement_changed()  # every restore follows a replacement or a resize
    # the rollout engine starts from the base weights: bring it to the checkpoint's
    await trainer.resync(data.eval_rows, trainer.state.step)
    if detached is not None:
        if not (directory / ASYNC_STATE).exists():
            raise FileNotFoundError(f"{directory / ASYNC_STATE} is missing: the checkpoint was written by a "
                                    "synchronous run; resume it with trainer.mode=sync")
        saved = torch.load(directory / ASYNC_STATE, weights_only=False)
        await detached.load_state_dict(saved, trainer.state.step, state["sampler"])
        log.info("async: %d buffered experience groups and %d prompts in the making queued again",
                 len(saved["entries"]), len(saved["rows"]))
    source = "memory" if set(sources) == {"memory"} else "disk"
    log.info("resumed at step %d from %s (model state from %s)", trainer.state.step, directory, source)
    return source
