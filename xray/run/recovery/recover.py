"""Lost Workhorses replaced: a PPO run goes on after a Workhorse's process dies.

When a step fails with a WholeModel error, `recover` pings every model's Workhorses
(`xray.run.recovery.dead`; a call can fail on a live model because another died), replaces each
model with a dead Workhorse on the same devices (`Models.replace`: a new process for each dead
shard, and the model's surviving shards, alive and free, rebuild in their own processes: all form
fresh process groups under the same WholeModel actor, `WholeModelActor.restart`; an
elastic device group that lost a device, its node gone, is placed again on what the cluster
grants, `xray.run.recovery.elastic`), then, in a synchronous run:
- a rollout, reference, teacher or reward model that died before the step trained (generation or
  scoring) holds nothing to restore: the rollout gets the actor's current weights (verified),
  the prompt sampler steps back, and the step runs again; training is not touched;
- otherwise (the actor or critic died, or anything died once training had begun) the actor,
  critic, trainer state and sampler go back to the newest complete snapshot in memory
  (`trainer.memory_snapshots`: the last step, or the one before when its snapshot was still being
  taken; `xray/run/checkpoints.py`), resharded by the engines when an elastic group shrank, from
  each shard's files or their copy on another node; where it cannot be read (a node left before
  its replica was made), to the one before still held in memory, then to the latest
  complete checkpoint on disk; and the steps since it run again, each once.
An asynchronous run replaces a lost experience maker itself, while the trainer goes on, and a
lost actor or critic while the makers go on, the trainer restoring its snapshot in memory
(`xray.run.detached.supervisor`); where it has none, `recover_async` goes back to the latest complete
checkpoint, its buffer and prompts in the making included, with new experience makers, trainer
and buffer.
At most `trainer.max_restarts` recoveries; one more death ends the run with the error.
A Workhorse that got SIGTERM (`xray/workhorse/drain.py`) is not waited for to die: `replace_drained`
replaces its model at the step boundary from the step's snapshot in memory, losing nothing (or at
once, the step under way aborted, when that step would outlast its grace: `xray.run.recovery.midstep`); in an
elastic group that can lose a device, on a node other than the head, the group shrinks away from
that node instead (`Elastic.drain`: Ray is told the node drains), from the same snapshot.
"""
from __future__ import annotations

import asyncio
import logging
import time

from xray.run.recovery.dead import dead_models
from xray.run.recovery.policy import RestartsExhausted
from xray.wholemodel.errors import WholeModelError

log = logging.getLogger(__name__)

UNTRAINED_PHASES = ("generate", "score")
"""Step phases before any weight changes."""


async def replace_dead(exc: WholeModelError, trainer, checkpoints, elastic=None
                       ) -> tuple[dict[str, list[int]], set[str], list[float]]:
    """Find the dead Workhorses and replace their models (or shrink their elastic groups); returns
    (role -> dead ranks, the groups shrunk, [start, found, replaced] times). The error again when
    no Workhorse died (a failure recovery cannot mend), `RestartsExhausted` past the limit."""
    t0 = time.perf_counter()
    dead = await asyncio.to_thread(dead_models, trainer.models)
    if not dead:
        raise exc
    found = time.perf_counter()
    restarts = trainer.restarts.spend(f"Workhorses died ({dead})", exc)
    await checkpoints.settle()  # before the dead models' handles go: their writes may be half done
    phase = getattr(exc, "phase", None)
    log.warning("Workhorses died during %s (role: ranks %s); replacing %s (restart %d of %d)",
                phase or "the step", dead, ", ".join(dead), restarts, trainer.restarts.limit)
    groups = {g for role in dead if elastic is not None and (g := elastic.group_of(role))
              and await asyncio.to_thread(elastic.lost_devices, g)}  # else its devices stand: replace
    for group in groups:
        await elastic.shrink(group)
    await replace_models(trainer, [r for r in dead if elastic is None or elastic.group_of(r) not in groups])
    return dead, groups, [t0, found, time.perf_counter()]


async def replace_models(trainer, roles: list[str]) -> None:
    """Start each of `roles`' models anew on its devices (the reward function's model too)."""
    for role in roles:
        new = await asyncio.to_thread(trainer.models.replace, role)
        if role == "reward" and hasattr(trainer.score_fn, "reward"):
            trainer.score_fn.reward = new


async def recover(exc: WholeModelError, trainer, data, checkpoints, run, sampler_state: dict,
                  elastic=None) -> None:
    """A synchronous run: replace the dead models and restore what the failure broke (see the
    module docstring)."""
    dead, groups, (t0, found, replaced) = await replace_dead(exc, trainer, checkpoints, elastic)
    if not groups and not set(dead) & {"actor", "critic"} and getattr(exc, "phase", None) in UNTRAINED_PHASES:
        data.sampler.load_state_dict(sampler_state)
        if "rollout" in dead:
            await trainer.resync(data.eval_rows, trainer.state.step)
        log.warning("%s replaced in %.1f s; step %d runs again", ", ".join(dead), time.perf_counter() - t0,
                    trainer.state.step + 1)
        return
    source = await back_to_checkpoint(exc, trainer, data, run, dead, checkpoints)
    log.warning("%s replaced; back at step %d, restored from %s (%.1f s after the failure "
                "was seen: %.1f s finding the dead, %.1f s starting Workhorses, %.1f s restoring and syncing "
                "the rollout)", ", ".join(dead), trainer.state.step, source, time.perf_counter() - t0,
                found - t0, replaced - found, time.perf_counter() - replaced)


async def back_to_checkpoint(exc: WholeModelError, trainer, data, run, dead: dict, checkpoints,
                             detached=None) -> str:
    """Restore the newest complete snapshot in memory (synchronous runs), else the latest complete
    checkpoint (from memory where it can); where it came from."""
    from xray.run.resume import resume_from

    latest = run.latest_checkpoint()
    on_disk = int(latest.name.split("-")[1]) if latest is not None else -1
    for held in checkpoints.restorables() if detached is None else []:
        if held.step < on_disk:
            break
        try:
            await resume_from(trainer, held.directory, data, None, checkpoints, state=held.trainer_state)
            return "the in-memory snapshot" + (" (replicated)" if held.replicated else "")
        except Exception as lost:  # noqa: BLE001 - lost with its node: an older one, or the disk's
            log.warning("the in-memory snapshot of step %d cannot be read (%s); trying an older one, then the "
                        "latest checkpoint", held.step, " ".join(str(lost).splitlines()[:2]))
    if latest is None:
        raise RestartsExhausted(f"{', '.join(dead)} died and there is no complete checkpoint to go back to") from exc
    return await resume_from(trainer, latest, data, detached, checkpoints)


async def recover_async(exc: WholeModelError, trainer, data, checkpoints, run):
    """An asynchronous run whose trainer failed (`xray.run.detached.supervisor`; its parts already stopped):
    replace the dead models and go back to the latest complete checkpoint, buffer included, with
    new makers and a new buffer; returns the new `Detached`."""
    from xray.run.detached.supervisor import Detached

    dead, _, (t0, found, replaced) = await replace_dead(exc, trainer, checkpoints)
    detached = Detached(trainer, data, str(run.path))
    source = await back_to_checkpoint(exc, trainer, data, run, dead, checkpoints, detached)
    log.warning("%s replaced; async run back at the checkpoint of step %d, restored from %s (%.1f s after the "
                "failure was seen: %.1f s finding the dead, %.1f s starting Workhorses, %.1f s restoring)",
                ", ".join(dead), trainer.state.step, source, time.perf_counter() - t0, found - t0,
                replaced - found, time.perf_counter() - replaced)
    return detached


async def replace_drained(notices: list[tuple[str, int, int]], trainer, data, checkpoints, run,
                          elastic=None, aborted: bool = False) -> None:
    """Replace each model with a Workhorse that got a drain notice (SIGTERM) after the step that just
    ended, once that step's snapshot is complete; in an elastic group that can lose it, on a node
    other than the head, shrink the group away from that node instead (`Elastic.drain`). A trained
    model, and the others trained with it, restore that snapshot (nothing is lost); a rollout takes
    the actor's weights, verified. `aborted`: the step under way was cancelled for the notices
    (`xray.run.recovery.midstep`): every trained model, the trainer's state and the sampler go back
    to the last snapshot whatever was drained, and that step runs again."""
    t0 = time.perf_counter()
    await checkpoints.settle()  # the snapshot of the step that ended: complete
    roles = sorted({role for role, _, _ in notices if getattr(trainer.models, role, None) is not None})
    log.warning("drain notice (SIGTERM) from %s; replacing %s %s step %d",
                ", ".join(f"{role} rank {rank} (pid {pid})" for role, rank, pid in notices), ", ".join(roles),
                "after" if not aborted else "having aborted", trainer.state.step + int(aborted))
    shrunk: set[str] = set()  # elastic groups that shrank away from a draining node
    for role, rank, _ in notices:
        group = elastic.group_of(role) if elastic is not None and role in roles else None
        if group is not None and group not in shrunk and (await elastic.drain(role, rank)) is not None:
            shrunk.add(group)
    await replace_models(trainer, [r for r in roles if elastic is None or elastic.group_of(r) not in shrunk])
    if shrunk or aborted or set(roles) & set(trainer.trained):
        source = await back_to_checkpoint(RuntimeError("drain notice"), trainer, data, run, {r: [] for r in roles},
                                          checkpoints)
    else:
        source = "nothing to restore"
        if "rollout" in roles:
            await trainer.resync(data.eval_rows, trainer.state.step)
    log.warning("%s %s after a drain notice in %.1f s; at step %d, restored from %s", ", ".join(roles),
                f"shrank ({', '.join(sorted(shrunk))})" if shrunk else "replaced", time.perf_counter() - t0,
                trainer.state.step, source)
