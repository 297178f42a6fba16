"""Lost Workhorses replaced: a synchronous PPO run goes on after a Workhorse's process dies.

When a step fails with a WholeModel error, `recover` pings every model's Workhorses
(`WholeModel.dead_ranks`; a call can fail on a live model because another died), replaces each
model with a dead Workhorse on the same devices (`Models.replace`: its surviving shards are
killed too, and the new ones form fresh process groups), then:
- a rollout, reference or reward model that died before the step trained (generation or
  scoring) holds nothing to restore: the rollout gets the actor's current weights (verified),
  the prompt sampler steps back, and the step runs again; training is not touched;
- otherwise (the actor or critic died, or anything died once training had begun) the actor,
  critic, trainer state and sampler go back to the latest complete checkpoint (from disk) and the
  steps since it run again, each once.
At most `trainer.max_restarts` recoveries; one more death ends the run with the error.
"""
from __future__ import annotations

import asyncio
import logging

from xray.wholemodel.errors import WholeModelError

log = logging.getLogger(__name__)

UNTRAINED_PHASES = ("generate", "score")
"""Step phases before any weight changes."""


class RestartsExhausted(RuntimeError):
    """Workhorses died more often than `trainer.max_restarts` allows."""


def dead_models(models) -> dict[str, list[int]]:
    """Role -> ranks whose Workhorse process is gone, for every model of the run with a death."""
    found = {}
    for role in ("actor", "critic", "reference", "reward", "rollout"):
        model = getattr(models, role, None)
        if model is not None and (ranks := model.dead_ranks()):
            found[role] = ranks
    return found


async def recover(exc: WholeModelError, trainer, data, checkpoints, run, sampler_state: dict, restarts: int) -> None:
    """Replace the dead models and restore what the failure broke (see the module docstring); the
    error again when no Workhorse died (a failure recovery cannot mend)."""
    dead = await asyncio.to_thread(dead_models, trainer.models)
    if not dead:
        raise exc
    limit = trainer.cfg.trainer.max_restarts
    if restarts > limit:
        raise RestartsExhausted(f"Workhorses died ({dead}), and the run already recovered {limit} times "
                                f"(trainer.max_restarts); raise it, or look at why they die: {exc}") from exc
    await checkpoints.settle()  # before the dead models' handles go: their writes may be half done
    phase = getattr(exc, "phase", None)
    log.warning("Workhorses died during %s (role: ranks %s); replacing %s (restart %d of %d)",
                phase or "the step", dead, ", ".join(dead), restarts, limit)
    for role in dead:
        new = await asyncio.to_thread(trainer.models.replace, role)
        if role == "reward" and hasattr(trainer.score_fn, "reward"):
            trainer.score_fn.reward = new
    if not set(dead) & {"actor", "critic"} and phase in UNTRAINED_PHASES:
        data.sampler.load_state_dict(sampler_state)
        if "rollout" in dead:
            await trainer.resync(data.eval_rows, trainer.state.step)
        log.warning("%s replaced; step %d runs again", ", ".join(dead), trainer.state.step + 1)
        return
    from algorithms.ppo.run import resume_from

    latest = run.latest_checkpoint()
    if latest is None:
        raise RestartsExhausted(f"{', '.join(dead)} died and there is no complete checkpoint to go back to") from exc
    await resume_from(trainer, latest, data)
    log.warning("%s replaced; back at the checkpoint of step %d", ", ".join(dead), trainer.state.step)
