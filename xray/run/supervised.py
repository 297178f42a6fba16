"""A supervised job's run: the actor alone, step by step, with the RL run's machinery around it.

`python -m xray.train sft` (and `pt`, `distill`, the built-in model's warm start: `algorithms/sft.py`)
trains the actor on batches its job makes from the step number (seeded), so a step is the same
wherever and whenever it runs. Everything around the steps is the synchronous RL run's own
(`xray/run/loop.py`), through a trainer and data of the shapes it drives:
- a snapshot in memory after every step and a flash checkpoint every `trainer.save_every`
  (`xray/run/checkpoints.py`), `--resume` from the latest, a signal ending the job at a step
  boundary with a checkpoint (`trainer.on_signal`), save at breakpoint on a fatal failure;
- a lost Workhorse replaced and the actor restored from the newest snapshot in memory
  (`xray/run/recovery/recover.py`), a SIGTERMed one replaced from its step's snapshot (a drain);
- with `actor.elasticity` (DLRover's elastic SFT: DeepSpeed's block, the seed's verbatim), the
  actor's device group shrinks when a device leaves and grows back when it returns
  (`xray/run/recovery/elastic.py`), resharded from the snapshot in memory; DeepSpeed's rule keeps one
  global batch at every size it allows (`supervised_batches`), so the job's numbers do not depend on
  how many devices trained each step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

from xray.config.batches import TrainBatches, supervised_batches
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.data.batch import Batch
from xray.run.checkpoints import FlashCheckpoints
from xray.run.outputs import RunDir
from xray.run.recovery.policy import RestartBudget
from xray.run.step import RunState

log = logging.getLogger(__name__)
BatchOf = Callable[[int, int], Batch]
"""`batch_of(step, rows)`: the job's training batch of `rows` sequences for `step` (seeded by it)."""


class StepSampler:
    """Where a supervised job is in its data: its batches are a function of the step, so the
    state is the last step drawn (a checkpoint keeps it, a step run again draws it again)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


@dataclasses.dataclass
class SupervisedData:
    """What the run's loop reads of a job's data (the RL run's `RunData`, for a supervised job)."""

    model_dir: str
    """The directory the actor started from (a checkpoint names it)."""
    sampler: StepSampler = dataclasses.field(default_factory=StepSampler)
    eval_rows: Any = None
    """A supervised job evaluates by its own held-out loss (`held_out_loss`), not through the run."""

    def next_train_rows(self) -> int:
        """The next step's number: its batch is made from it (`SupervisedTrainer.step`)."""
        self.sampler.step += 1
        return self.sampler.step


class NoKL:
    """A supervised job has no KL controller; checkpoints keep its (empty) state all the same."""

    value = 0.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class SupervisedTrainer:
    """The actor's steps of one supervised job, as the run's loop and recovery drive a trainer."""

    trained = ("actor",)
    score_fn = None

    def __init__(self, cfg: RunConfig, models, batch_of: BatchOf, loss, steps: int, name: str = "sft"):
        self.cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=steps))
        """The job's config, `trainer.steps` its own (`sft.steps`): the loop runs to it."""
        self.models, self.batch_of, self.loss, self.algo = models, batch_of, loss, name
        self.state = RunState()
        self.kl = NoKL()
        self.restarts = RestartBudget(cfg.trainer.max_restarts)
        self.rollout_rows: list[dict] = []

    def batches(self) -> TrainBatches:
        """Sequences per step and the actor's micro-batch for its current number of devices."""
        return supervised_batches(self.cfg, {"actor": self.models.plan.role("actor").num_workhorses})

    async def step(self, step: int) -> dict[str, float]:
        """Train step `step` (the sampler's: the one after `state.step`) on its batch; its metrics."""
        if step != self.state.step + 1:
            raise RuntimeError(f"the job is at step {self.state.step} and was asked for step {step}: the sampler "
                               "and the trainer's state were restored from different snapshots")
        t0 = time.perf_counter()
        b = self.batches()
        batch = self.batch_of(step, b.mini_batch_size)
        metrics = await self.models.actor.train_step(batch, self.loss, b.micro_of("actor"))
        self.state.step = step
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    async def resync(self, eval_rows, step: int) -> None:
        """No rollout to bring to the restored weights."""


async def train_supervised(trainer: SupervisedTrainer, run: RunDir, data: SupervisedData, resume: bool,
                           on_step: Callable[[int, dict], None]) -> None:
    """The job's steps from the latest checkpoint (`resume`) or the start to `trainer.cfg.trainer.steps`,
    each ending with `on_step(step, metrics)` after its checkpoint or snapshot (`xray.run.loop`)."""
    from xray.run.loop import checkpoint_at_signal, checkpoint_step, guarded, sync_steps
    from xray.run.resume import resume_from

    latest = run.latest_checkpoint() if resume else None
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run.checkpoints}; start without --resume")
    if latest is not None:
        await resume_from(trainer, latest, data)
    checkpoints = FlashCheckpoints(run, trainer.models, trainer.trained)

    async def ended(step: int, metrics: dict) -> None:
        await checkpoint_step(trainer, checkpoints, data, None, step, metrics)
        on_step(step, metrics)

    async def steps(stop) -> None:
        await sync_steps(trainer, run, data, checkpoints, stop, ended)
        if stop.requested:
            await checkpoint_at_signal(trainer, checkpoints, data, stop, None)

    await guarded(trainer.cfg, run, checkpoints, True, steps)


def supervised_models(cfg: RunConfig, plan: Plan, model_dir: str, ray_address: str | None):
    """The actor's WholeModel of a supervised job, on its device group (elastic: on as many devices
    as the cluster grants now), as `Models` (the recovery replaces and resizes it)."""
    from xray.run.models import build_models

    return build_models(cfg, dataclasses.replace(plan, roles=(plan.role("actor"),)), model_dir, ray_address)


def job_dir(output_dir: Path, resume: str | None) -> Path:
    """Where a job writes: `--resume DIR`'s run, else `output_dir`."""
    return Path(resume) if resume not in (None, "latest") else output_dir
