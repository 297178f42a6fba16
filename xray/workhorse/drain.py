"""Drain notices: a Workhorse told to stop (SIGTERM: its node draining, a preemption notice) says
so, and a run replaces it, losing nothing, instead of finding it dead in a step: a synchronous run
at the next step boundary from that step's snapshot in memory (`xray/run/checkpoints.py`); an
asynchronous one (`xray/run/detached/supervisor.py`, `Detached.drained`) a rollout replica or a
scoring model at once, a trained model once the trainer has finished its step and its snapshot.

`listen` (each Workhorse, at start) turns SIGTERM into a notice to the run's `DrainInbox`, a named
actor of the driver's job that a run opens before it starts its models (`open_inbox`),
and a deadline: the Workhorse goes on serving for `trainer.drain_grace_s` seconds (the inbox
holds it; 30 by default, as a preempted Kubernetes pod gets) and then exits.
A synchronous run takes the notices after each step, an asynchronous one twice a second
(`DrainInbox.take`: one call to an idle actor, not queued behind the Workhorses' snapshot copies),
and replaces the models that got one (`xray/run/recovery/recover.py`, `replace_drained`). Without an
inbox (a notebook's models) SIGTERM ends the Workhorse at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)
GRACE_S = 30.0
"""A Workhorse's grace after SIGTERM unless the run says otherwise (`trainer.drain_grace_s`)."""


class DrainInbox:
    """Ray actor (zero CPUs, named per job): the drain notices not yet taken, and the grace a
    Workhorse keeps serving for after its SIGTERM."""

    def __init__(self) -> None:
        self.notices: list[tuple[str, int, int]] = []
        self.grace_s = GRACE_S

    def set_grace(self, grace_s: float) -> None:
        self.grace_s = float(grace_s)

    def grace(self) -> float:
        return self.grace_s

    def notify(self, role: str, rank: int, pid: int) -> None:
        self.notices.append((role, rank, pid))

    def take(self) -> list[tuple[str, int, int]]:
        """The notices since the last take: (role, rank, pid) each."""
        notices, self.notices = self.notices, []
        return notices


def inbox_name() -> str:
    import ray

    return f"xray-drain-{ray.get_runtime_context().get_job_id()}"


_held: list = []
"""The driver's handle of the inbox: a named actor lives while a handle of its creator does."""


def open_inbox(placement: dict | None = None, grace_s: float | None = None):
    """This job's inbox (started if none, with Ray options `placement`: the run puts it on the head
    node, where the WholeModel actors live, so that no Workhorse node's loss takes it), emptied of
    what an earlier run left in it; with `grace_s`, the grace of the Workhorses started from now on."""
    import ray

    if _held:  # this process's own (a handle got by name would not keep it alive)
        try:
            ray.get(_held[0].take.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - of an earlier cluster
            _held.clear()
    if not _held:
        inbox = ray.remote(num_cpus=0)(DrainInbox).options(name=inbox_name(), get_if_exists=True,
                                                           **(placement or {})).remote()
        ray.get(inbox.take.remote())
        _held[:] = [inbox]
    if grace_s is not None:
        ray.get(_held[0].set_grace.remote(grace_s))
    return _held[0]


_TOLD: list[bool] = []
"""Set once this process got SIGTERM (`draining`)."""


def draining() -> bool:
    """Whether this process got a SIGTERM and will exit at its grace's end."""
    return bool(_TOLD)


def listen(role: str, rank: int) -> None:
    """In a Workhorse's process: if a run opened the job's inbox, SIGTERM tells it and the process
    exits the inbox's grace later (`trainer.drain_grace_s`; a second SIGTERM: at once). Otherwise, and off the main thread,
    SIGTERM stays Ray's (the process exits)."""
    import ray

    if not ray.is_initialized() or threading.current_thread() is not threading.main_thread():
        return
    try:
        inbox = ray.get_actor(inbox_name())
    except ValueError:  # no run listening: a notebook's models
        return
    try:
        grace_s = ray.get(inbox.grace.remote(), timeout=10)
    except Exception as exc:  # noqa: BLE001 - an inbox that does not answer: the default grace
        log.warning("%s rank %d: the run's drain inbox did not give its grace (%s); %.0f s", role, rank, exc, GRACE_S)
        grace_s = GRACE_S
    told = _TOLD

    def notify() -> None:
        try:
            ray.get(inbox.notify.remote(role, rank, os.getpid()), timeout=10)
        except Exception as exc:  # noqa: BLE001 - the run is gone: exit at the deadline
            log.warning("%s rank %d: SIGTERM; the run's drain inbox did not answer (%s)", role, rank, exc)

    def on_sigterm(signum, frame) -> None:
        if told:
            os._exit(1)
        told.append(True)
        threading.Thread(target=notify, daemon=True).start()
        deadline = threading.Timer(grace_s, os._exit, args=(0,))
        deadline.daemon = True
        deadline.start()

    signal.signal(signal.SIGTERM, on_sigterm)
