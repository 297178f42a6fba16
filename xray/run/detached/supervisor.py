"""Detached asynchronous PPO and critic-free runs (`trainer.mode: async`): the driver's part, which
only supervises.

ColossalChat's design on xray's WholeModels, each part a Ray actor with its own loop:
- the **buffer** (`xray.run.detached.buffer`): the prompt source, admission control and the queue of
  scored groups, held as object references;
- one **experience maker** per rollout replica (`xray.run.detached.maker`): lease prompts, sample,
  have the reference and the reward score by reference, put each group into the buffer;
- the **trainer** (`xray.run.detached.trainer`): take what is ready, recompute, train, publish
  weight versions to the makers without waiting for them.
The buffer and the trainer are placed as the WholeModels are (`control_plane_placement`: on the head
node, outside every device reservation), so neither goes with a lost Workhorse's node. The driver
starts them, streams the trainer's per-step metrics to `on_step` (loggers, progress,
checkpoints), lets the trainer run up to the next checkpoint step and takes the checkpoint there
(the trainer's state, and the buffer's snapshot read at one instant: nothing lost, nothing
trained twice on a resume), replaces a lost maker while the others and the trainer go on (its
prompts queued again; the replacement loads the latest published version first), and stops them.
No experience byte passes through the driver (a checkpoint's snapshot excepted, which it writes).
When the trainer loses its actor or critic, the driver replaces those models and the trainer
restores the snapshot in memory it took after its last step (`trainer.memory_snapshots`;
`AsyncTrainer.recover`) while the makers and the buffer go on: at most the step in flight runs
again, on the groups it had taken (given back by the buffer, which keeps the last takes, not
skipped). When the trainer actor itself dies, a new one takes over from the newest snapshot the
trained models still keep of a step the driver saw end (`recover_learner`), the makers and the
buffer going on. Without a complete snapshot the error ends `run`, and the run's recovery
(`xray.run.recovery.recover.recover_async`) goes back to the latest checkpoint (written from the
trainer's newest snapshot first, when it is newer: save at breakpoint). Interleaving is not
deterministic: runs are not bitwise repeatable.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from xray.config.graph import build_graph
from xray.run.recovery.policy import RestartsExhausted
from xray.run.detached.trainer import TRAINER_STATE
from xray.run.rollout_log import ROLLOUT_ROWS
from xray.workhorse.train import KEPT_SNAPSHOTS
from xray.wholemodel.errors import WholeModelError
from xray.wholemodel.handle import control_plane_placement

log = logging.getLogger(__name__)
STOP_GRACE_S = 30.0
"""How long a failing run waits for the trainer to finish its step (it may be waiting on experience
that will not come) before stopping it."""


class MakerLost(RestartsExhausted):
    """Makers failed more often than `trainer.max_restarts` allows."""


class Detached:
    """The makers, buffer and trainer of one asynchronous run around the driver's `RLTrainer` (its
    models, data and scorer), supervised."""

    def __init__(self, trainer, data, run_path: str | None = None):
        import ray

        from xray.run.detached.buffer import BufferActor

        self.trainer, self.data = trainer, data
        cfg, models = trainer.cfg, trainer.models
        self.graph = build_graph(cfg.async_.feeds, cfg.async_.pushes, models.rollout.parallel.dp,
                                 models.actor.parallel.dp)
        self.share = cfg.ppo.rollout_batch_size // self.graph.trainers
        """Prompts a maker leases at a time, and each trainer takes a step."""
        a = cfg.async_
        self.buffer = ray.remote(BufferActor).options(num_cpus=0, **control_plane_placement()).remote(
            data.train, data.sampler, self.share, [list(f) for f in self.graph.feeds], a.max_staleness,
            a.on_stale, a.buffer_capacity, trainer.state.step)
        self.makers: list = []
        self.runs: list = []
        self.learner = None
        self.trainer_runs = 0
        """Calls of the trainer's `run` so far (of the trainer actor now running)."""
        self.kl_states: dict[int, dict] = {}
        """Step -> the trainer's KL state after it, for the last steps this driver saw end and logged: a
        trainer taking over from one that died restores it with the step's snapshot (`recover_learner`)."""
        self.run_path = run_path
        """The run's directory: the trainer's snapshots in memory are named under it (None: none taken)."""
        self.handed: dict[str, set[int]] = {}
        """Role -> the makers that went on when it was replaced (given the new one: `use_models`); one of
        them failing on the old one is the same fault, not counted again."""
        from xray.workhorse.drain import open_inbox

        self.inbox = open_inbox()
        """The drain notices of SIGTERMed Workhorses (`xray/workhorse/drain.py`), read twice a second."""
        self.draining: set[str] = set()
        """Trained roles told to drain: replaced once the trainer has stopped after its step."""
        self.settle_driver = None
        """Awaited before a drained trained model is replaced (`run`'s `settle`)."""

    # -- the parts -------------------------------------------------------------------------------
    def _maker(self, i: int, version: int):
        import ray

        from xray.run.detached.maker import ExperienceMaker

        t, m = self.trainer, self.trainer.models
        slow = os.environ.get("XRAY_MAKER_SLOWDOWN", "")  # a test hook: "<maker>:<factor>"
        slowdown = float(slow.split(":")[1]) if slow and int(slow.split(":")[0]) == i else 1.0
        return ray.remote(ExperienceMaker).options(num_cpus=0, max_concurrency=1000).remote(
            i, m.rollout.replica(i), m.reference if t.uses_reference else None, t.score_fn, self.buffer, t.cfg,
            t.stop_ids, t.pad_id, self.share, version, slowdown, self.data.tokenizer if t.cfg.env.name else None,
            teacher=m.teacher if t.teacher_coef else None)

    def start(self) -> None:
        """Start the makers' loops and the trainer (from the driver's trainer state)."""
        t = self.trainer
        self.makers = [self._maker(i, t.state.step) for i in range(len(self.graph.feeds))]
        self.runs = [_retrieved(asyncio.ensure_future(m.run.remote())) for m in self.makers]
        self.start_learner()

    def start_learner(self, publish: bool = True) -> None:
        """Start the trainer actor from the driver's trainer state (`publish`: see `AsyncTrainer`)."""
        import ray

        from xray.run.detached.trainer import AsyncTrainer

        t = self.trainer
        models = dataclasses.replace(t.models, starter=None)
        self.learner = ray.remote(AsyncTrainer).options(num_cpus=0, max_concurrency=1000,
                                                        **control_plane_placement()).remote(
            t.cfg, models, t.pad_id, t.stop_ids, self.buffer, self.makers, list(self.graph.pusher), t.state.step,
            t.kl.state_dict(), self.data.model_dir, self.run_path, t.algorithm, publish)
        self.trainer_runs = 0

    async def stop(self) -> None:
        """Stop the makers and the trainer, and free the buffer."""
        import ray

        for m in self.makers:
            m.stop.remote()
        await asyncio.gather(*self.runs, return_exceptions=True)
        for actor in [*self.makers, self.learner, self.buffer]:
            if actor is not None:
                ray.kill(actor)
        self.makers, self.runs, self.learner = [], [], None

    # -- the run ---------------------------------------------------------------------------------
    async def run(self, steps: range, on_step, stop=None, on_stop=None, settle=None) -> None:
        """Trainer steps `steps` with the makers running beside them; awaits `on_step(step, metrics)`
        after each (metrics, checkpoints at `trainer.save_every`, between which the trainer runs
        on its own); ends early when `stop` (a `GracefulStop`) is requested, awaiting `on_stop()`
        (the last checkpoint) while the buffer still stands. `settle()` is awaited before a trained
        model told to drain is replaced (the driver's checkpoint being taken from it completes).
        The makers end holding the trainer's last weights (for the evaluation)."""
        from ray.exceptions import RayActorError

        self.settle_driver = settle
        cfg = self.trainer.cfg
        self.start()
        try:
            first = steps.start
            while first < steps.stop and not (stop is not None and stop.requested):
                every = cfg.trainer.save_every
                until = min(steps.stop - 1, ((first - 1) // every + 1) * every if every else steps.stop - 1)
                try:
                    await self.segment(first, until, on_step, stop)
                except WholeModelError as exc:
                    await self.recover_trainer(exc)
                    first = self.trainer.state.step + 1
                    continue
                except RayActorError as exc:
                    if not await self.learner_died(exc):
                        raise
                    await self.recover_learner(exc)
                    first = self.trainer.state.step + 1
                    continue
                if self.draining:  # the trainer stopped after its step for a drain notice
                    await self.replace_drained_trained()
                    first = self.trainer.state.step + 1
                    continue
                if self.trainer.state.step < first and not (stop is not None and stop.requested):
                    raise RuntimeError(f"the trainer stopped before step {first} without an error or a signal")
                first = self.trainer.state.step + 1
            if stop is not None and stop.requested and on_stop is not None:
                await self.pull_state()
                await on_stop()
            else:
                await unwrapped(self.learner.finish.remote())
        except Exception:
            from xray.run.breakpoint import save_async_at_breakpoint

            await save_async_at_breakpoint(self)
            raise
        finally:
            await self.stop()

    async def segment(self, first: int, until: int, on_step, stop) -> None:
        """The trainer's steps `first..until` on its own; each step's metrics to `on_step` as it
        ends (the last after the trainer stopped: its checkpoint sees it at rest). A signal stops
        the trainer after the step under way, whose metrics are still passed on: every step it
        trained is logged before the run's last checkpoint. Makers that fail meanwhile are
        replaced; a failure of the trainer is raised, as is `MakerLost` once makers failed too
        often (the trainer, maybe waiting for their experience, is then given `STOP_GRACE_S`)."""
        running = _retrieved(asyncio.ensure_future(self.learner.run.remote(until)))
        self.trainer_runs += 1
        try:
            for step in range(first, until + 1):
                metrics = await self.metrics_of(step, stop)
                if metrics is None:
                    break  # the trainer stopped before this step: a signal, or its error (raised below)
                self.trainer.state.step = step
                self.trainer.rollout_rows = metrics.pop(ROLLOUT_ROWS, [])  # the loop writes them, not a metric
                kl = metrics.pop(TRAINER_STATE)["kl"]
                if step == until:
                    await unwrapped(running)
                    await self.pull_state()
                await on_step(step, metrics)
                # a step a new trainer may take over from (`recover_learner`) once its metrics are logged: one
                # whose end failed (its trainer died first) runs again rather than go unlogged
                kept = {s: state for s, state in self.kl_states.items() if s > step - KEPT_SNAPSHOTS}
                self.kl_states = {**kept, step: kl}
            await unwrapped(running)
        except BaseException:  # the trainer may wait on the buffer for makers that are gone: do not wait long
            await self._stop_trainer(running, STOP_GRACE_S)
            raise

    async def _stop_trainer(self, running: asyncio.Future, wait_s: float) -> None:
        """Ask the trainer to end its `run` after the step under way and wait for it, at most
        `wait_s` (`stop` kills it after that)."""
        if not running.done():
            self.learner.request_stop.remote()
            await asyncio.wait([running], timeout=wait_s)

    async def metrics_of(self, step: int, stop) -> dict | None:
        """Step `step`'s metrics from the trainer (None: it stopped before it), replacing the
        makers that fail while it trains and passing a signal on to it."""
        got = _retrieved(asyncio.ensure_future(self.learner.next_metrics.remote(step, self.trainer_runs)))
        while True:
            done, _ = await asyncio.wait([got, *self.runs], return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
            if stop is not None and stop.requested:
                self.learner.request_stop.remote()
            failed = [i for i, r in enumerate(self.runs) if r in done]
            if failed:
                await self.replace_failed(failed)
            if notices := await self.inbox.take.remote():  # every step too: steps may be shorter than 0.5 s
                await self.drained(notices)
            if got.done():
                return await unwrapped(got)

    async def drained(self, notices: list[tuple[str, int, int]]) -> None:
        """Workhorses told to drain (SIGTERM: a preemption notice; each goes on serving for its grace,
        `trainer.drain_grace_s`): a rollout replica's maker is stopped (its prompts queued again) and
        the replica restarted with a new maker, a reference, teacher or reward model started anew and
        handed to the makers, at once; a trained model once the trainer has finished the step under
        way (`replace_drained_trained`). None of it counts against `trainer.max_restarts`."""
        models = self.trainer.models
        log.warning("drain notice (SIGTERM) from %s", ", ".join(f"{role} rank {rank} (pid {pid})"
                                                                 for role, rank, pid in notices))
        roles = {role for role, _, _ in notices}
        trained = roles & set(self.trainer.trained)
        if trained and (self.run_path is None or not self.trainer.cfg.trainer.memory_snapshots):
            log.warning("no snapshot in memory to restore %s from (trainer.memory_snapshots is off): it is "
                        "recovered as a lost Workhorse when it exits", ", ".join(sorted(trained)))
        elif trained:
            self.draining |= trained
            self.learner.request_stop.remote()  # after the step under way, whose snapshot is then taken
        t0 = time.perf_counter()
        replicas = sorted({models.rollout.layout[rank].dp_rank for role, rank, _ in notices if role == "rollout"})
        scorers = sorted(roles & {"reference", "teacher", "reward"})
        if not replicas and not scorers:
            return
        await self._remake(replicas, replicas, scorers)
        log.warning("%s replaced after a drain notice in %.1f s; the trainer and the other makers went on",
                    ", ".join([f"experience maker {i}" for i in replicas] + scorers), time.perf_counter() - t0)

    async def replace_drained_trained(self) -> None:
        """The trainer stopped after its step for a drain notice to `draining`: once that step's
        snapshot in memory is complete, start those models anew and have the trainer restore it
        (nothing runs again) while the makers and the buffer went on."""
        roles, self.draining = sorted(self.draining), set()
        t0 = time.perf_counter()
        await unwrapped(self.learner.settle.remote())  # the last step's snapshot, from the draining Workhorses
        if self.settle_driver is not None:  # and a checkpoint the driver is taking from them
            await self.settle_driver()
        for role in roles:
            await asyncio.to_thread(self.trainer.models.replace, role)
        state = await unwrapped(self.learner.recover.remote(dataclasses.replace(self.trainer.models, starter=None)))
        self.trainer.state.step = state["step"]
        self.trainer.kl.load_state_dict(state["kl"])
        log.warning("%s replaced after a drain notice in %.1f s; the trainer is at step %d, restored from %s; the "
                    "makers and the buffer went on", ", ".join(roles), time.perf_counter() - t0, state["step"],
                    "the in-memory snapshot" if state["source"] == "memory" else "disk")

    async def pull_state(self) -> None:
        """The driver's trainer takes the trainer actor's state (step, KL controller), for a checkpoint."""
        state = await self.learner.state.remote()
        self.trainer.state.step = state["step"]
        self.trainer.kl.load_state_dict(state["kl"])

    async def replace_failed(self, failed: list[int]) -> None:
        """Replace the makers whose loops ended with an error, while the trainer and the other
        makers go on: their prompts are queued again; a dead rollout Workhorse's replica is
        restarted alone on its devices, a dead reference, teacher or reward model anew (handed to the
        makers that go on: `_replace_scorers`; their queued groups are the buffer's and stay), and
        each new maker loads the trainer's latest published version before it samples."""
        from xray.run.recovery.dead import dead_models

        errors = {}
        for i in failed:
            try:
                await self.runs[i]
                errors[i] = RuntimeError(f"maker {i} stopped without an error")
            except Exception as exc:  # noqa: BLE001 - inspected below
                errors[i] = _cause(exc)
            log.warning("experience maker %d failed: %s", i, errors[i])
        first = next(iter(errors.values()))
        counted = [i for i in failed if not self._same_fault(i, errors[i])]
        if counted:
            self.trainer.restarts.spend(f"experience maker{'s' if len(counted) > 1 else ''} "
                                        f"{', '.join(map(str, counted))} failed", first, len(counted), MakerLost)
        t0 = time.perf_counter()
        dead = await asyncio.to_thread(dead_models, self.trainer.models)
        if set(dead) & {"actor", "critic"}:
            raise first  # the trainer's loss: the run's recovery
        models = self.trainer.models
        replicas = sorted({models.rollout.layout[r].dp_rank for r in dead.get("rollout", [])})
        again = sorted(set(failed) | set(replicas))
        latest = await self._remake(again, replicas, sorted(set(dead) - {"rollout"}))
        log.warning("experience maker%s %s replaced in %.1f s at weight version %d (%s; dead Workhorses: %s; "
                    "rollout replicas restarted: %s); the trainer and the other makers went on",
                    "s" if len(again) > 1 else "", ", ".join(map(str, again)), time.perf_counter() - t0,
                    latest[again[0]].version, "; ".join(f"maker {i}: {type(e).__name__}" for i, e in errors.items()),
                    dead or "none", replicas or "none")

    async def _remake(self, makers: list[int], replicas: list[int], scorers: list[str]) -> dict:
        """Stop `makers` (their prompts queued again), restart the rollout `replicas` alone on their
        devices, start the scoring models `scorers` anew for the makers that go on, and start new
        `makers` at the latest published version; that version, per maker."""
        await self.stop_makers(makers)
        for replica in replicas:
            await asyncio.to_thread(self.trainer.models.rollout.restart_replica, replica)
        await self._replace_scorers(scorers, [i for i in range(len(self.makers)) if i not in makers])
        return await self._start_makers(makers)

    def _same_fault(self, maker: int, error: BaseException) -> bool:
        """Whether `maker` failed on a scoring model already replaced while it went on (its call was
        under way on the old one): the fault was counted when that model was replaced."""
        role = getattr(error, "role", None)
        if maker in self.handed.get(role, set()):
            self.handed[role].discard(maker)
            return True
        return False

    async def _replace_scorers(self, roles: list[str], others: list[int]) -> None:
        """Start the dead scoring models `roles` (reference, teacher, reward) anew and hand them to the
        makers `others`, which go on with their queued and in-flight work (nothing of theirs lost)."""
        new = {}
        for role in roles:
            new[role] = await asyncio.to_thread(self.trainer.models.replace, role)
            if role == "reward" and hasattr(self.trainer.score_fn, "reward"):
                self.trainer.score_fn.reward = new[role]
            self.handed[role] = set(others)
        given = {k: v for k, v in new.items() if k in ("reference", "teacher", "reward")}
        if given and others:
            await asyncio.gather(*[unwrapped(self.makers[i].use_models.remote(**given)) for i in others])

    async def learner_died(self, exc) -> bool:
        """Whether the actor error `exc` is the trainer actor's death (it names it, or, naming none,
        the trainer does not answer)."""
        if exc.actor_id is not None:
            return exc.actor_id == self.learner._actor_id.hex()
        try:
            await asyncio.wait_for(self.learner.state.remote(), 10.0)
        except Exception:  # noqa: BLE001 - gone, or not answering: dead to this run
            return True
        return False

    async def recover_learner(self, exc: BaseException) -> None:
        """The trainer actor died (its process, or the head node's): a new one takes over from the
        newest snapshot of a step this driver saw end that the trained models still keep
        (`AsyncTrainer.adopt`: restored as after a lost Workhorse, the groups taken since given back
        by the buffer, which kept them), while the makers and the buffer go on. Re-raises `exc`
        when trained Workhorses died too, or none keeps such a snapshot (the run's recovery then
        goes back to its checkpoint)."""
        from xray.run.recovery.dead import dead_models

        t0 = time.perf_counter()
        self.trainer.restarts.spend("the trainer actor died", exc, error=MakerLost)
        dead = await asyncio.to_thread(dead_models, self.trainer.models)
        if self.run_path is None or set(dead) & set(self.trainer.trained):
            raise exc
        self.start_learner(publish=False)
        steps = sorted(self.kl_states.items(), reverse=True)
        state = await unwrapped(self.learner.adopt.remote(steps, dataclasses.replace(self.trainer.models,
                                                                                      starter=None)))
        if state is None:
            log.warning("the trainer actor died and the models keep no snapshot of steps %s; going back to "
                        "the latest checkpoint", [s for s, _ in steps])
            raise exc
        self.trainer.state.step = state["step"]
        self.trainer.kl.load_state_dict(state["kl"])
        log.warning("the trainer actor died (%s); a new one took over at step %d from the snapshot its models "
                    "kept, in %.1f s; the groups of %d step%s it had taken given back to the buffer to train again; "
                    "the makers and the buffer went on", type(exc).__name__, state["step"], time.perf_counter() - t0,
                    state["given_back"], "" if state["given_back"] == 1 else "s")

    async def recover_trainer(self, exc: WholeModelError) -> None:
        """The trainer's step failed: replace the dead models (the rollout's replicas are the makers'
        to replace) and have the trainer restore the newest snapshot in memory while the makers and
        the buffer go on (at most the step in flight runs again). Re-raises `exc` when nothing
        trained died or no snapshot is complete (the run's recovery then goes back to its checkpoint)."""
        from xray.run.recovery.dead import dead_models

        t0 = time.perf_counter()
        dead = await asyncio.to_thread(dead_models, self.trainer.models)
        if self.run_path is None or not set(dead) & set(self.trainer.trained):
            raise exc
        self.trainer.restarts.spend(f"the trainer's Workhorses died ({dead})", exc, error=MakerLost)
        log.warning("the trainer lost Workhorses (role: ranks %s); replacing %s, the makers and the buffer go on",
                    dead, ", ".join(sorted(set(dead) - {"rollout"})))
        for role in sorted(set(dead) & set(self.trainer.trained)):
            await asyncio.to_thread(self.trainer.models.replace, role)
        scorers = sorted(set(dead) - {"rollout"} - set(self.trainer.trained))  # handed to the makers, which go on
        await self._replace_scorers(scorers, list(range(len(self.makers))))
        try:
            state = await unwrapped(self.learner.recover.remote(dataclasses.replace(self.trainer.models, starter=None)))
        except RuntimeError as why:
            log.warning("the trainer cannot restore from memory (%s); going back to the latest checkpoint", why)
            raise exc from None
        self.trainer.state.step = state["step"]
        self.trainer.kl.load_state_dict(state["kl"])
        log.warning("%s replaced; the trainer is back at step %d, restored from %s in %.1f s, the groups of %d "
                    "lost step%s given back to the buffer to train again; the makers and the buffer went on",
                    ", ".join(sorted(set(dead) - {"rollout"})), state["step"],
                    "the in-memory snapshot" if state["source"] == "memory" else "disk", time.perf_counter() - t0,
                    state["given_back"], "" if state["given_back"] == 1 else "s")

    async def _start_makers(self, which: list[int]) -> dict:
        """New makers `which` (the old ones stopped), at the trainer's latest published version,
        which they load first; that version, per maker."""
        latest, rollback = await self.learner.latest.remote(), await self.learner.epoch.remote()
        for i in which:
            self.makers[i] = self._maker(i, -1)
            await unwrapped(self.makers[i].load.remote(latest[i], *rollback))
            self.runs[i] = _retrieved(asyncio.ensure_future(self.makers[i].run.remote()))
        await self.learner.set_makers.remote(self.makers)
        return latest

    async def stop_makers(self, which: list[int]) -> None:
        """Stop makers `which` and queue their prompts again."""
        import ray

        for i in which:
            self.makers[i].stop.remote()
        await asyncio.gather(*[self.runs[i] for i in which], return_exceptions=True)
        for i in which:
            ray.kill(self.makers[i])
            requeued = await self.buffer.requeue.remote(i)
            log.info("maker %d stopped; its %d prompts in the making queued again", i, requeued)

    # -- checkpoints -----------------------------------------------------------------------------
    async def state_dict(self) -> dict:
        """The buffer's snapshot, read at one instant: the sampler's state, the prompts to make
        again and the ready groups with their experiences."""
        return await self.buffer.snapshot.remote()

    async def load_state_dict(self, state: dict, version: int, sampler: dict) -> None:
        """Resume at trainer `version` (before `run`): the checkpoint's groups queued again, its
        prompts made first, the sampler where it was."""
        await self.buffer.restore.remote({**state, "sampler": sampler}, version)


def _cause(exc: BaseException) -> BaseException:
    """The error a Ray task raised, not Ray's wrapper."""
    from ray.exceptions import RayTaskError

    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


async def unwrapped(ref):
    try:
        return await ref
    except Exception as exc:  # noqa: BLE001 - re-raised unwrapped
        raise _cause(exc) from None


def _retrieved(future: asyncio.Future) -> asyncio.Future:
    """`future`, its failure marked as seen: the run handles it where it waits (a failed maker is
    replaced, a failed trainer ends or recovers the run), and an error that ends the run leaves no
    "Task exception was never retrieved" with Ray's text behind the run's own message."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
