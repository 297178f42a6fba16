"""Flash checkpoints of a run: a short blocking copy to host memory, the disk write behind it.

Every `trainer.save_every` steps the algorithm calls `FlashCheckpoints.take`: each trained
WholeModel's Workhorses copy their state into host memory (`TrainWorkhorse.snapshot`; the only
time training stops) and write it to `checkpoints/step-N/<role>/` from a background thread, while
the run's own files (the async buffer, for instance) are written off the event loop. `take` only
submits the snapshot calls: the run goes on to its next step at once (generation needs no trained
Workhorse), and Ray runs a caller's calls to a Workhorse in the order they were made, so the copy
is of the state after this step, and the next step's first call to that Workhorse waits for it.
The copy's seconds (the slowest shard's) arrive later, in `stall_s`. Once every copy is done the
Workhorses are told to write theirs (`TrainWorkhorse.persist_snapshot`) and to answer the files,
which the object store keeps on their node for this process: they outlive the Workhorses, and
`held_for` gives a model of the same layout the references to restore from (`TrainWorkhorse.load`);
only the latest complete checkpoint's (and the one being written) are kept. The
checkpoint becomes the run's latest only when all of it is on disk: a watcher polls the writers
(`poll`), or `finish` waits for them (before the run ends), and then writes `trainer_state.json`,
the marker `RunDir.latest_checkpoint` looks for, atomically. A crash while writing leaves the previous
checkpoint the latest. One checkpoint is written at a time: a new one first finishes the last.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xray.backends.snapshot import write_atomically
from xray.run.outputs import RunDir

log = logging.getLogger(__name__)


@dataclass
class _Writing:
    directory: Path
    trainer_state: dict[str, Any]
    snapshots: asyncio.Future
    """The Workhorses' copies: their seconds, per role."""
    files: asyncio.Future
    started: float


class FlashCheckpoints:
    """Takes and completes the flash checkpoints of one run's trained WholeModels."""

    def __init__(self, run: RunDir, models: Any, roles: tuple[str, ...] = ("actor", "critic")):
        self.run, self._models, self.roles = run, models, roles
        """`models` holds the WholeModels as attributes named by `roles` (read at each use: a
        replaced model is checkpointed, not the one it replaced)."""
        self.writing: _Writing | None = None
        self._watcher: asyncio.Future | None = None
        self.written_s: float | None = None
        """Seconds from snapshot to on disk of the last checkpoint completed (for the step's metrics)."""
        self.stall_s: float | None = None
        """Seconds training stopped for the last snapshot taken (its slowest copy), once known."""
        self.last_step: int | None = None
        """The step of the last checkpoint taken (complete or being written)."""
        self._held: dict[Path, dict[str, tuple[Any, list]]] = {}
        """Checkpoint directory -> role -> (the layout it was taken in, every rank's `persist_snapshot` reference)."""

    @property
    def models(self) -> dict[str, Any]:
        return {role: getattr(self._models, role) for role in self.roles}

    async def take(self, step: int, trainer_state: dict[str, Any], files: dict[str, Any] | None = None
                   ) -> asyncio.Future:
        """Snapshot every model at `step` (submitted, not awaited: see the module docstring) and
        start writing; returns a future of the seconds training stopped (the slowest copy's)."""
        await self.finish()
        directory = self.run.checkpoint_dir(step)
        directory.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        models = self.models
        copies = [m.snapshot(str(directory / role)) for role, m in models.items()]  # in order, now
        snapshots = asyncio.ensure_future(self._copied(directory, models, copies))
        writes = [asyncio.to_thread(write_atomically, obj, str(directory / name)) for name, obj in (files or {}).items()]
        self.writing = _Writing(directory, trainer_state, snapshots, asyncio.ensure_future(asyncio.gather(*writes)), t0)
        self.last_step = step
        self._watcher = asyncio.ensure_future(self._watch())
        return snapshots

    async def _copied(self, directory: Path, models: dict[str, Any], copies: list) -> float:
        """Once every Workhorse's copy is done (the writes, started only then, do not slow a copy
        down), have them write it and hold their answers, the files in memory."""
        self.stall_s = max(await asyncio.gather(*copies))
        self._held[directory] = {role: (m.parallel, m.persist_snapshot().refs) for role, m in models.items()}
        return self.stall_s

    async def _watch(self, every_s: float = 0.05) -> None:
        """Mark the checkpoint complete soon after its last byte is written (each poll waits behind
        the Workhorses' current call); a failure is left to `settle`/`finish`."""
        try:
            while self.writing is not None:
                await asyncio.sleep(every_s)
                await self.poll()
        except Exception:  # noqa: BLE001 - a dead writer: recovery settles the checkpoint
            pass

    async def poll(self) -> float | None:
        """Mark the checkpoint being written complete if it is all on disk; its write's seconds then."""
        if self.writing is None or not (self.writing.snapshots.done() and self.writing.files.done()):
            return None
        flags = await asyncio.gather(*[m.persisted() for m in self.models.values()])
        return self._complete() if all(flags) else None

    async def finish(self) -> float | None:
        """Wait until the checkpoint being written is on disk, and mark it complete."""
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and not watcher.done():
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if self.writing is None:
            return None
        await self.writing.snapshots
        await self.writing.files
        await asyncio.gather(*[m.wait_persisted() for m in self.models.values()])
        return self._complete()

    async def settle(self) -> None:
        """After a Workhorse died: finish the checkpoint being written if every writer lives, else
        abandon it (never marked complete: the previous one stays the latest)."""
        if self.writing is None:
            return
        try:
            await self.finish()
        except Exception as exc:  # noqa: BLE001 - a writer died with its Workhorse
            log.warning("checkpoint %s abandoned: %s", self.writing.directory, str(exc).splitlines()[0])
            self._held.pop(self.writing.directory, None)
            self.writing = None

    def held_for(self, directory: Path, role: str, model: Any) -> list | None:
        """The references of `role`'s snapshot files for checkpoint `directory`, if this run holds
        them and `model` has the layout they were taken in (else None: load from disk)."""
        parallel, refs = self._held.get(Path(directory), {}).get(role, (None, None))
        return refs if refs is not None and parallel == model.parallel and len(refs) == len(model.layout) else None

    def _complete(self) -> float:
        w, self.writing = self.writing, None
        w.snapshots.result(), w.files.result()  # a failed copy or write of the run's own files raises here
        self.run.write_trainer_state(w.directory, w.trainer_state)
        self._held = {d: h for d, h in self._held.items() if d == w.directory}  # older ones: freed
        seconds = self.written_s = time.perf_counter() - w.started
        log.info("checkpoint complete: %s (written in %.1f s)", w.directory, seconds)
        return seconds
