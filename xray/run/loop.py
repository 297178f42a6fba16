"""The RL run: what `python -m xray.train ppo` (or grpo, rloo, reinforce_pp, opd, or any registered
RL algorithm) does after the config is checked, the same for every algorithm (it knows one only
through `xray/run/algorithm.py`).

Reads like the script it is: prepare the model and data, start the WholeModels, evaluate
(`xray.run.evaluate`, which writes each evaluation's responses), loop steps with progress, metrics,
a few rollouts as text (`xray.run.rollout_log`) and checkpoints (and the timeline of step `trainer.timeline_step`,
`xray.run.timeline`), evaluate again, export the actor, write the run report (`xray.report`), and
return (eval_before, eval_after). `--resume` continues from the latest checkpoint of a run. A
synchronous run steps here (`sync_steps`); an asynchronous one supervises its detached makers and
trainer (`xray/run/detached/`); both recover from lost Workhorses (`xray/run/recovery/`).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterator

from xray.config.eval import eval_max_new_tokens
from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.config.typed import to_dict
from xray.rewards.model import ModelScorer
from xray.run.algorithm import Algorithm
from xray.run.breakpoint import save_at_breakpoint
from xray.run.checkpoints import FlashCheckpoints
from xray.run.evaluate import Evaluations
from xray.run.final import export_actor
from xray.run.graceful import GracefulStop, RunInterrupted
from xray.run.inputs import BUILTIN_MODEL, RunData, prepare
from xray.run.models import build_models, check_layouts, join_cluster
from xray.run.outputs import RunDir
from xray.run.progress import StepProgress
from xray.run.resume import resume_from, save_checkpoint
from xray.run.rollout_log import RolloutLog
from xray.run.step import RLTrainer
from xray.run.timeline import StepTimeline

log = logging.getLogger(__name__)
Warm = Callable[[RunConfig, Plan, RunDir, "str | None"], "tuple[str, RunConfig]"]
"""`warm(cfg, plan, run, ray_address) -> (model_dir, cfg)`: the actor's model directory (a built-in
model built and warm-started where the config names one) and the config with the teacher's
directory filled in; the algorithms layer supplies it (`algorithms/rl.py`)."""


def make_trainer(algorithm: Algorithm, cfg: RunConfig, models, score, data: RunData) -> RLTrainer:
    """The trainer of `algorithm`; with `env.name` or `env.agent`, its samples are episodes
    (`xray.run.episodes.samples`, `xray.run.episodes.agents`)."""
    trainer = RLTrainer(cfg, models, score, data.pad_id, data.stop_ids, algorithm)
    trainer.more_rows = data.next_train_rows  # dynamic sampling's further prompts
    if cfg.env.agent:
        from xray.run.episodes.agents import AgentSamples

        trainer.episodes = AgentSamples(cfg, models.rollout, data.tokenizer, data.pad_id)
    elif cfg.env.name:
        from xray.run.episodes.samples import EpisodeSamples

        trainer.episodes = EpisodeSamples(cfg, models.rollout, data.tokenizer, data.pad_id)
    return trainer


@contextmanager
def started(cfg: RunConfig, plan: Plan, run: RunDir, algorithm: Algorithm, warm: Warm,
            ray_address: str | None = None) -> Iterator:
    """Prepare the model and prompts, start the run's WholeModels, and yield (trainer, RunData)
    for `algorithm`; the WholeModels are shut down on the way out (the run, the benchmarks and
    the tests use it)."""
    model_dir, cfg = warm(cfg, plan, run, ray_address)
    with ThreadPoolExecutor(max_workers=1) as pool:  # the tokenizer and prompts load while Ray starts
        preparing = pool.submit(prepare, cfg, run, model_dir)
        try:
            join_cluster(cfg, plan, ray_address)  # the main thread's: Ray's start sets signal handlers
        finally:
            data = preparing.result()  # a bad input fails here, before any model starts
    models = build_models(cfg, plan, data.model_dir, ray_address)
    try:
        score = data.score or ModelScorer(models.reward, cfg.reward.on_nonfinite)
        yield make_trainer(algorithm, cfg, models, score, data), data
    finally:
        models.shutdown()


def run_rl(cfg: RunConfig, plan: Plan, output_dir: Path, resume: str | None, ray_address: str | None,
           algorithm: Algorithm, warm: Warm) -> tuple[float, float]:
    """The whole run of `algorithm`; (eval_before, eval_after)."""
    t_start = time.perf_counter()
    if cfg.model.path != BUILTIN_MODEL:
        check_layouts(cfg, plan, cfg.model.path)  # before anything is built or started
    eval_max_new_tokens(cfg)  # the evaluations fit the rollout engine's context, or say how
    run = RunDir(Path(resume) if resume not in (None, "latest") else output_dir, cfg.trainer.loggers)
    run.write_config(to_dict(cfg))
    with run, started(cfg, plan, run, algorithm, warm, ray_address) as (trainer, data):  # loggers close either way
        eval_after = asyncio.run(train(trainer, run, data, resume))
    if cfg.trainer.report:
        from xray.report.write import report_at_end

        report_at_end(run.path)
    log.info("run finished in %.0f s; outputs in %s", time.perf_counter() - t_start, run.path)
    return trainer.state.eval_before, eval_after


async def train(trainer: RLTrainer, run: RunDir, data: RunData, resume: str | None) -> float:
    """The run's one event loop: resume, evaluate, steps with progress, metrics and flash
    checkpoints, evaluate again, and export the actor as a Hugging Face directory. A signal ends
    it at a step boundary with a checkpoint (`RunInterrupted`)."""
    cfg = trainer.cfg
    latest = run.latest_checkpoint() if resume else None
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run.checkpoints}; "
                                "start without --resume")
    detached = None
    if cfg.trainer.mode == "async":
        from xray.run.detached.supervisor import Detached

        detached = Detached(trainer, data, str(run.path))
    if latest is not None:
        await resume_from(trainer, latest, data, detached)
    details = {}  # every metric of the evaluations; an episode run's also their episode metrics
    evaluations = Evaluations(trainer, data.eval_rows, run, data.tokenizer)  # and their samples files
    rollouts = RolloutLog(run.rollouts_path, data.tokenizer, trainer.state.step)
    if trainer.state.eval_before is None:
        details["metrics_before"] = await evaluations(trainer.state.step)
        trainer.state.eval_before = details["metrics_before"]["eval"]
        if trainer.episodes is not None:
            details["episodes_before"] = dict(trainer.episodes.metrics)
    log.info("eval before training: %.3f", trainer.state.eval_before)
    checkpoints = FlashCheckpoints(run, trainer.models, trainer.trained, keep_on_peers=detached is None)
    await guarded(cfg, run, checkpoints, detached is None,
                  lambda stop: train_steps(trainer, run, data, detached, checkpoints, stop, evaluations, rollouts))
    details["metrics_after"] = await evaluations(trainer.state.step)
    eval_after = details["metrics_after"]["eval"]
    if trainer.episodes is not None:
        details["episodes_after"] = dict(trainer.episodes.metrics)
    run.write_evals(trainer.state.eval_before, eval_after, trainer.state.step, details)
    if trainer.episodes is not None:
        await trainer.episodes.close()  # an agent endpoint stops serving (a later run starts it again)
    await asyncio.to_thread(export_actor, trainer.models.actor, cfg.actor.lora, data.model_dir, run.path / "final")
    return eval_after


async def guarded(cfg: RunConfig, run: RunDir, checkpoints: FlashCheckpoints, breakpoint: bool,
                  steps: Callable[[GracefulStop], Awaitable[None]]) -> None:
    """Run `steps(stop)` under the run's signal handling (`trainer.on_signal`: a signal ends it at
    a step boundary with a checkpoint, then `RunInterrupted`); on a failure, complete the checkpoint
    under way and (`breakpoint`) write the newest snapshot in memory if newer (save at breakpoint);
    the last checkpoint finished on the way out. An RL run's steps and a supervised job's alike."""
    stop = GracefulStop(cfg.trainer.on_signal, cfg.trainer.exit_grace_s).install()
    checkpoints.warm_replicas()
    try:
        await steps(stop)
        if stop.requested:
            await stopped(checkpoints, run)
    except Exception:
        await checkpoints.settle()  # a checkpoint taken before the failure is whole: complete it
        if breakpoint:  # the newest snapshot in memory, if newer, becomes a checkpoint
            await save_at_breakpoint(checkpoints, run)
        raise
    finally:
        stop.uninstall()
    await checkpoints.finish()


async def checkpoint_step(trainer, checkpoints: FlashCheckpoints, data, detached, step: int, metrics: dict) -> None:
    """What every step of a run ends with: the last checkpoint's figures into the step's `metrics`
    once known, a checkpoint every `trainer.save_every` steps, else (synchronous runs) a snapshot in
    memory (`trainer.memory_snapshots`: at most the step in flight lost)."""
    cfg = trainer.cfg
    if checkpoints.written_s is not None:
        metrics["checkpoint/write_s"], checkpoints.written_s = checkpoints.written_s, None
    if checkpoints.stall_s is not None:
        metrics["checkpoint/stall_s"], checkpoints.stall_s = checkpoints.stall_s, None
    if cfg.trainer.save_every and step % cfg.trainer.save_every == 0:
        await save_checkpoint(trainer, checkpoints, data, detached)
    elif cfg.trainer.memory_snapshots and detached is None:
        await save_checkpoint(trainer, checkpoints, data, persist=False)


async def checkpoint_at_signal(trainer, checkpoints: FlashCheckpoints, data, stop: GracefulStop, detached) -> None:
    """A signal ended the steps: checkpoint the last finished step, unless it is saved already or
    the signal abandoned the run (a second one)."""
    if not stop.abandoned and checkpoints.last_step != trainer.state.step and trainer.state.step > 0:
        await save_checkpoint(trainer, checkpoints, data, detached)


async def train_steps(trainer: RLTrainer, run: RunDir, data: RunData, detached, checkpoints: FlashCheckpoints,
                      stop: GracefulStop, evaluations: Evaluations, rollouts: RolloutLog) -> None:
    """The steps from the one after the resumed (or 0) to `trainer.steps`, or to a signal; each
    step's sampled rollouts go to `rollouts`, and every `trainer.eval_every` steps `evaluations` runs."""
    cfg = trainer.cfg
    steps = range(trainer.state.step + 1, cfg.trainer.steps + 1)
    progress = StepProgress(steps, f"{trainer.algo} ({cfg.trainer.mode})",
                            cfg.ppo.rollout_batch_size * cfg.rollout.n_samples, trainer.state.eval_before)
    timeline = StepTimeline(cfg.trainer.timeline_step, run.path)  # busy intervals of one step, per role and rank
    await timeline.begin(trainer.state.step + 1, trainer.models)
    current = [detached]  # the live async machinery: a recovery replaces it (`async_steps`)

    async def on_step(step: int, metrics: dict) -> None:
        await timeline.end(step, trainer.models)
        await checkpoint_step(trainer, checkpoints, data, current[0], step, metrics)
        rollouts.write(step, trainer.rollout_rows)  # a few of the step's responses as text
        trainer.rollout_rows = []
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            metrics.update(await evaluations(step))  # `eval`, `eval/*`
        if step % cfg.trainer.log_every == 0:
            run.log_metrics(step, metrics)
        progress.step(metrics)  # the one progress line: xray.run.progress
        await timeline.begin(step + 1, trainer.models)

    async def on_stop() -> None:
        await checkpoint_at_signal(trainer, checkpoints, data, stop, current[0])

    with progress:
        if detached is not None:
            await async_steps(trainer, run, data, current, checkpoints, stop, on_step, on_stop)
        else:
            await sync_steps(trainer, run, data, checkpoints, stop, on_step)
            if stop.requested:
                await on_stop()


async def async_steps(trainer: RLTrainer, run: RunDir, data: RunData, current: list, checkpoints: FlashCheckpoints,
                      stop: GracefulStop, on_step, on_stop) -> None:
    """Asynchronous steps to `trainer.steps`, or to a signal; lost makers or trainers are
    recovered (`xray.run.recovery.recover`), from a step-0 checkpoint if none is newer. `current[0]`
    is the live `Detached`: a recovery replaces it there, where `on_step` and `on_stop` read it."""
    from xray.run.recovery.recover import recover_async
    from xray.wholemodel.errors import WholeModelError

    cfg = trainer.cfg
    if cfg.trainer.max_restarts and run.latest_checkpoint() is None:
        await save_checkpoint(trainer, checkpoints, data, current[0])  # somewhere to go back to
    while True:
        try:
            await current[0].run(range(trainer.state.step + 1, cfg.trainer.steps + 1), on_step, stop, on_stop,
                                 checkpoints.settle)
            break
        except WholeModelError as exc:  # makers and buffer are stopped: start them again
            current[0] = await recover_async(exc, trainer, data, checkpoints, run)


async def sync_steps(trainer: RLTrainer, run: RunDir, data: RunData, checkpoints: FlashCheckpoints,
                     stop: GracefulStop, on_step) -> None:
    """Synchronous steps to `trainer.steps`; a step that loses a Workhorse is recovered
    (`xray.run.recovery.recover`), from a step-0 checkpoint if none is newer; a Workhorse that got
    SIGTERM is replaced at the step boundary (`xray/workhorse/drain.py`), or at once with the step
    aborted when the step would outlast its grace (`xray.run.recovery.midstep`); elastic device groups grow at
    step boundaries when devices join (`xray.run.recovery.elastic`)."""
    from xray.run.recovery.elastic import Elastic
    from xray.run.recovery.midstep import StepAborted, StepDrains
    from xray.run.recovery.recover import recover, replace_drained
    from xray.workhorse.drain import open_inbox
    from xray.wholemodel.errors import WholeModelError

    cfg = trainer.cfg
    elastic = Elastic(trainer)
    # drain notices: SIGTERMed Workhorses (xray/workhorse/drain.py), read during steps too (midstep.py)
    drains = StepDrains(await asyncio.to_thread(open_inbox), cfg.trainer.drain_grace_s)
    if (cfg.trainer.max_restarts or elastic.ranges) and run.latest_checkpoint() is None:
        await save_checkpoint(trainer, checkpoints, data)  # somewhere to go back to
    while trainer.state.step < cfg.trainer.steps and not stop.requested:
        sampler_state = data.sampler.state_dict()
        try:
            metrics = await stop.guard(drains.run(trainer.step(data.next_train_rows())))
            if metrics is None:
                break
            if elastic.ranges:
                metrics.update(elastic.metrics())
            await on_step(trainer.state.step, metrics)
            if notices := await drains.take():
                await replace_drained(notices, trainer, data, checkpoints, run, elastic if elastic.ranges else None)
            if trainer.models.standby:  # standby processes follow the nodes (trainer.standby_workhorses)
                await asyncio.to_thread(trainer.models.keep_standby)
            if elastic.ranges and trainer.state.step < cfg.trainer.steps and not stop.requested:
                await elastic.grow(lambda: save_checkpoint(trainer, checkpoints, data), checkpoints,
                                   lambda directory, state: resume_from(trainer, directory, data, None, checkpoints,
                                                                        state=state))
        except WholeModelError as exc:
            await recover(exc, trainer, data, checkpoints, run, sampler_state, elastic)
        except StepAborted as aborted:  # a drained Workhorse the step would not outlive: no restart charged
            log.warning("%s", aborted)
            await replace_drained(aborted.notices, trainer, data, checkpoints, run,
                                  elastic if elastic.ranges else None, aborted=True)


async def stopped(checkpoints: FlashCheckpoints, run: RunDir) -> None:
    """After a signal (and its checkpoint): wait until the checkpoint is on disk, and raise
    `RunInterrupted` with the resume command."""
    await checkpoints.finish()
    latest = run.latest_checkpoint()
    raise RunInterrupted(int(latest.name.split("-")[1]) if latest else 0,
                         resume_command(run.path) if latest else "nothing to resume (no checkpoint was complete)")


def resume_command(run_path: Path) -> str:
    """This command line again, with `--resume RUN_DIR` in place of any `--resume`."""
    import shlex

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg == "--resume" or arg.startswith("--resume="):
            skip = arg == "--resume"
            continue
        args.append(arg)
    return " ".join(["python -m xray.train", *map(shlex.quote, args), "--resume", shlex.quote(str(run_path))])
