"""Snapshots of a run in memory every step, flash checkpoints on disk every `trainer.save_every`.

After every step (`trainer.memory_snapshots`; else at checkpoints only) the algorithm calls
`FlashCheckpoints.take` (a synchronous run's driver; an asynchronous run's trainer actor, whose
calls it orders): each trained WholeModel's Workhorses copy their state into host memory
(`TrainWorkhorse.snapshot`, the only time training stops), then hand it over as a call's answer
owned by their WholeModel actor (`WholeModel.hand_snapshot`: issued by the actor right behind the
copy, the model's next call waiting for it), which the object store keeps after the Workhorse and
the caller die, the Workhorse keeping no copy of its own; on a
cluster of several nodes, a `SnapshotHolder` on another node keeps a replica of each shard's
answer (`xray/run/snapshot_holder.py`), which `held_for` reads in place of a shard lost with its
node, and a node's loss loses none of it; a model whose data-parallel replicas' files are alike
(Megatron) and spread over nodes is its own replica: a lost rank's file is read from a peer's, and
in a synchronous run (`keep_on_peers`) only one rank of each position hands its files out, the
others keeping theirs in their process until a restore asks (`materialize`); a hander lost while
the snapshot is taken (its node gone mid-hand) then costs nothing: its keepers' copies stand in
(`_salvage`), and the restore reads them. `take` only submits the
calls: the run goes on to its next step at once (generation needs no trained Workhorse), and Ray
runs a caller's calls to a Workhorse in the order they were made, so the copy is of the state
after this step, and the next step's first call to that Workhorse waits for it. The copy's
seconds (the slowest shard's) arrive later, in `stall_s`. A snapshot is usable as soon as every
shard's answer is in (and replicated): `in_memory` is the newest such, with the trainer's state of
the same instant, and a recovery or an elastic resize restores it (`held_for`) into models of its
layout or of another (resharded by the engine from the files in memory), whether or not it
reached the disk.

At a checkpoint step the Workhorses also write that snapshot to `checkpoints/step-N/<role>/` from
a background thread (`persist_snapshot`, reading the handed answer where it lies), while the run's
own files (the async buffer, for instance) are written off the event loop. The checkpoint becomes
the run's latest on disk only when all of it is there: a watcher polls the writers (`poll`), or
`finish` waits for them (before the run ends), and then writes `trainer_state.json`, the marker
`RunDir.latest_checkpoint` looks for, atomically. A crash while writing leaves the previous
checkpoint the latest. One checkpoint is written at a time: a new one first finishes the last.
Memory holds the newest complete snapshot, the one being taken and the latest checkpoint's; older
ones are freed. Once a checkpoint is complete, those on disk older than the newest `keep_last`
(`trainer.keep_last`, given by `take`) are deleted (`RunDir.prune_checkpoints`): never the one
being written, nor the newest complete one, which a resume or a recovery loads, nor one whose
snapshot memory holds.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
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
    keep_last: int = 0
    """Complete checkpoints to keep on disk once this one is (0: all)."""


@dataclass
class Held:
    """A complete snapshot in memory."""

    step: int
    directory: Path
    """The checkpoint directory its files are named under (written there or not)."""
    roles: dict[str, tuple[Any, list]]
    """Role -> (the layout it was taken in, every rank's reference to its files)."""
    trainer_state: dict[str, Any]
    """The trainer's state at the same instant (what `trainer_state.json` holds)."""
    replicas: dict[str, tuple[list[str], list]] = field(default_factory=dict)
    """Role -> (every rank's node when it was taken, the reference to each rank's replica on
    another node, `SnapshotHolder`'s own object); empty on a single node."""
    peers: frozenset[str] = frozenset()
    """The roles whose replicas are their data-parallel peers' files (none copied: `peers_elsewhere`)."""
    kept: dict[str, str] = field(default_factory=dict)
    """Role -> the key its ranks that did not hand their files (reference None) keep them under
    in their process (`handers`), until `materialize` asks for them."""

    @property
    def replicated(self) -> bool:
        """Whether every role's shards were replicated to other nodes (a shard whose holder was
        lost with its node keeps none: its original lives on)."""
        return bool(self.replicas) and set(self.replicas) == set(self.roles)


class FlashCheckpoints:
    """Takes the in-memory snapshots and the flash checkpoints of one run's trained WholeModels."""

    def __init__(self, run: RunDir, models: Any, roles: tuple[str, ...] = ("actor", "critic"),
                 keep_on_peers: bool = False):
        self.run, self._models, self.roles, self.keep_on_peers = run, models, roles, keep_on_peers
        """`models` holds the WholeModels as attributes named by `roles` (read at each use: a
        replaced model is snapshotted, not the one it replaced)."""
        self.writing: _Writing | None = None
        self._watcher: asyncio.Future | None = None
        self.written_s: float | None = None
        """Seconds from snapshot to on disk of the last checkpoint completed (for the step's metrics)."""
        self.stall_s: float | None = None
        """Seconds training stopped for the last snapshot taken (its slowest copy), once known."""
        self.last_step: int | None = None
        """The step of the last checkpoint taken (complete or being written)."""
        self._held: dict[Path, Held] = {}
        """Checkpoint directory -> its complete snapshot in memory."""
        self.in_memory: Held | None = None
        """The newest complete snapshot in memory."""
        self._on_disk: Path | None = None
        self._taking: list[asyncio.Future] = []
        """The snapshots being taken (their `_copied`)."""
        self._replicas: Any = None
        """The `Replicator`: the holders of the replicas, one per node (`xray/run/snapshot_holder.py`)."""
        self._moved = True
        """Whether the trained shards' nodes must be looked up again."""
        self._peer_roles: frozenset[str] = frozenset()
        """The roles whose replicas were each other's copies at the last snapshot."""
        self._watching = asyncio.Lock()

    @property
    def models(self) -> dict[str, Any]:
        return {role: getattr(self._models, role) for role in self.roles}

    async def take(self, step: int, trainer_state: dict[str, Any], files: dict[str, Any] | None = None,
                   persist: bool = True, keep_last: int = 0) -> asyncio.Future:
        """Snapshot every model at `step` into memory (submitted, not awaited: see the module
        docstring) and, with `persist`, start writing it as a checkpoint, after which only the
        newest `keep_last` complete checkpoints stay on disk (0: all); returns a future of the
        seconds training stopped (the slowest copy's)."""
        if persist:
            await self.finish()
        directory = self.run.checkpoint_dir(step)
        t0 = time.perf_counter()
        models = self.models
        key = f"{directory}@{uuid.uuid4().hex[:12]}"  # this take's: another caller may snapshot `directory` too
        copies = [m.snapshot(str(directory / role), f"{role}:{key}") for role, m in models.items()]  # in order, now
        ranks = {role: None if persist else self._handers(role, m) for role, m in models.items()}
        handed = [m.hand_snapshot(str(directory / role), f"{role}:{key}", copy, ranks=ranks[role])
                  for (role, m), copy in zip(models.items(), copies)]
        kept = {role: f"{role}:{key}" for role, r in ranks.items() if r is not None}
        snapshots = asyncio.ensure_future(self._copied(step, directory, models, copies, handed, trainer_state, persist,
                                                       key, kept, ranks))
        snapshots.add_done_callback(lambda f: f.cancelled() or f.exception())  # a loss: recovery's to handle
        self._taking = [f for f in self._taking if not f.done()] + [snapshots]
        if persist:
            directory.mkdir(parents=True, exist_ok=True)
            writes = [asyncio.to_thread(write_atomically, obj, str(directory / name)) for name, obj in (files or {}).items()]
            files_written = asyncio.ensure_future(asyncio.gather(*writes))
            self.writing = _Writing(directory, trainer_state, snapshots, files_written, t0, keep_last)
            self.last_step = step
            self._watcher = asyncio.ensure_future(self._watch())
        return snapshots

    def _handers(self, role: str, model: Any) -> list[int] | None:
        """The ranks of `role` that hand this snapshot out (`handers`), the others keeping theirs,
        when `keep_on_peers` and its replicas were each other's copies at the last snapshot, on the
        nodes they still sit on; else None: every rank hands."""
        from xray.run.snapshot_holder import handers, peers_elsewhere

        nodes = self._replicas.nodes.get(role) if self._replicas is not None else None
        if not self.keep_on_peers or self._moved or role not in self._peer_roles or nodes is None or \
                len(nodes) != model.parallel.world_size or not peers_elsewhere(model.parallel, nodes):
            return None
        return handers(model.parallel, nodes, self._replicas.driver)

    async def _copied(self, step: int, directory: Path, models: dict[str, Any], copies: list, handed: list,
                      trainer_state: dict[str, Any], persist: bool, key: str, kept: dict[str, str],
                      handing: dict[str, list[int] | None]) -> float:
        """Once every Workhorse's copy is done and handed over (`handed`: to the WholeModel actors,
        which own the answers), with `persist`, have them write it from there; once every answer is
        in (and replicated), the snapshot is complete. A role whose copy or hand failed on some
        rank is complete all the same when its keepers' copies cover every position (`_salvage`)."""
        copied = await asyncio.gather(*copies, return_exceptions=True)
        await asyncio.gather(*handed)  # every hand is done (an outcome each: handed_snapshot's)
        refs = await asyncio.gather(*[m.handed_snapshot(f"{role}:{key}") for role, m in models.items()],
                                    return_exceptions=True)
        seconds = [c for c in copied if not isinstance(c, BaseException)]
        if len(seconds) < len(copied) or any(isinstance(r, BaseException) for r in refs):
            refs, salvaged = await self._salvage(step, models, copies, copied, refs, handing)
            seconds += salvaged
        self.stall_s = max(seconds)
        roles = {role: (m.parallel, r) for (role, m), r in zip(models.items(), refs)}
        if persist:
            for role, m in models.items():
                m.persist_snapshot(f"{role}:{key}", roles[role][1])
        replicas, peers = await self._replicate(str(directory), models, roles, set(kept))
        held = self._held[directory] = Held(step, directory, roles, trainer_state, replicas, peers, kept)
        if self.in_memory is None or step >= self.in_memory.step:
            self.in_memory = held
        self._prune()
        return self.stall_s

    async def _salvage(self, step: int, models: dict[str, Any], copies: list, copied: list, refs: list,
                       handing: dict[str, list[int] | None]) -> tuple[list, list[float]]:
        """A snapshot whose copy or hand failed on some ranks (their process, or their node, died
        while it was taken): a role whose ranks did not all hand (`handers`: the others keep their
        copies in their process) stands when, at every tensor and pipeline position, a keeper's
        copy is done: its references are then all None, the keepers hand theirs at a restore
        (`materialize`) and they restore the lost ranks too (`held_for`: a live peer). Any other
        failure is raised, as before (the snapshot is not complete). Returns every role's
        references and the salvaged copies' seconds."""
        from xray.run.snapshot_holder import dp_peers

        out, seconds = list(refs), []
        for i, (role, model) in enumerate(models.items()):
            cause = next((o for o in (copied[i], refs[i]) if isinstance(o, BaseException)), None)
            if cause is None:
                continue
            if handing.get(role) is None:  # every rank handed: a lost rank's files are gone
                raise cause
            outcomes = await asyncio.gather(*copies[i].refs, return_exceptions=True)
            done = {rank: o for rank, o in zip(copies[i].ranks, outcomes) if not isinstance(o, BaseException)}
            keepers = set(done) - set(handing[role])
            parallel = model.parallel
            if not all(keepers & {rank, *dp_peers(parallel, rank)} for rank in range(parallel.world_size)):
                raise cause
            out[i] = [None] * parallel.world_size
            seconds += [done[rank] for rank in keepers]
            failures = getattr(cause, "failures", None)  # a WholeModelError's, by rank
            why = failures[0].message if failures else str(cause)
            log.warning("snapshot of step %d: %s's copy or hand failed on ranks %s (%s); the copies ranks %s keep in "
                        "their processes stand in", step, role, [f.rank for f in failures] if failures else "?",
                        why.splitlines()[0][:160] if why else type(cause).__name__, sorted(keepers))
        return out, seconds

    async def _replicate(self, key: str, models: dict[str, Any], roles: dict[str, tuple], kept: set[str]
                         ) -> tuple[dict[str, tuple[list[str], list]], frozenset[str]]:
        """A replica of each shard's files on another node: role -> (each rank's node, each rank's
        replica), none on a single node; and the roles whose replicas are their data-parallel
        peers on other nodes, of which no copy is made. A node that leaves while the copies are
        made takes its holder's replicas with it (of shards on other nodes, which live on) and
        its shards, whose replicas elsewhere are kept: the snapshot stays usable (CI saw three
        steps' snapshots discarded when a new node's holder, still importing, was lost with its
        node). The `kept` roles (some ranks kept their files) count as such roles."""
        from xray.run.snapshot_holder import peers_elsewhere

        self._peer_roles = frozenset()  # until this look finds them
        try:
            if self._moved or self._replicas is None:  # else the nodes of the last look: no call to Ray's GCS
                await self.watch_nodes(models)
                self._moved = False
        except Exception:  # noqa: BLE001 - a shard's node left while its node was looked up
            self._moved = True
            return {}, frozenset()
        if len(self._replicas.holders) < 2:
            return {}, frozenset()
        nodes = self._replicas.nodes
        peers = self._peer_roles = frozenset(role for role, (parallel, _) in roles.items()
                                             if replicas_identical(models[role]) and peers_elsewhere(parallel, nodes[role]))
        peers |= kept
        copied = {role: refs for role, (_, refs) in roles.items() if role not in peers}
        held = await self._replicas.hold(key, copied) if copied else {}
        if not copied:
            self._replicas.release()
        if any(copy is None for _, copies in held.values() for copy in copies):
            self._moved = True  # a holder's node left: look again at the next snapshot
        return {**held, **{role: (list(nodes[role]), [None] * len(nodes[role])) for role in peers}}, peers

    async def watch_nodes(self, models: dict[str, Any] | None = None) -> int:
        """Holders for the replicas on every live node (started as nodes join: an elastic grow calls
        this before starting its Workhorses, so that the new node's holder is warm by the next
        snapshot); with `models`, their shards' nodes looked up. The number of live nodes."""
        from xray.run.snapshot_holder import Replicator

        async with self._watching:  # one look at a time: two would start two holders on a new node
            if self._replicas is None:
                self._replicas = await asyncio.to_thread(Replicator)
            return await asyncio.to_thread(self._replicas.refresh, models)

    def warm_replicas(self) -> None:
        """Start the replicas' holders now, in the background (a run's start): the first snapshot's
        copies then need not wait for a holder to start and import torch (~2 s, measured), during
        which a lost node would take that snapshot's only copy with it."""
        warming = asyncio.ensure_future(self.watch_nodes())
        warming.add_done_callback(lambda f: f.cancelled() or f.exception())  # the next snapshot looks again

    async def adopt(self, step: int, trainer_state: dict[str, Any]) -> bool:
        """Take over the snapshot of `step` that the trained models' WholeModel actors still keep
        (`WholeModel.kept_snapshot`), taken by a caller that is gone (an asynchronous run's trainer
        actor), as this one's newest complete snapshot in memory (unreplicated; `trainer_state` is
        the gone caller's of that step). False when one no longer keeps it."""
        directory = self.run.checkpoint_dir(step)
        models = self.models
        kept = await asyncio.gather(*[m.kept_snapshot(str(directory / role)) for role, m in models.items()])
        if any(refs is None for refs in kept):
            return False
        roles = dict(zip(models, kept))  # role -> (the layout it was taken in, every rank's reference)
        self.in_memory = self._held[directory] = Held(step, directory, roles, trainer_state)
        return True

    def follow(self, models: Any) -> None:
        """Snapshot `models` from now on (they replaced the ones given at construction)."""
        self._models = models
        self._moved = True

    def placement_changed(self) -> None:
        """The trained models moved (replaced, resized): their shards' nodes are looked up again at
        the next snapshot."""
        self._moved = True

    def _prune(self) -> None:
        """Free every snapshot but the newest, the one being written and the latest on disk."""
        keep = {self.in_memory.directory if self.in_memory else None, self._on_disk,
                self.writing.directory if self.writing else None}
        self._held = {d: h for d, h in self._held.items() if d in keep}
        if self._replicas is not None:
            self._replicas.keep([str(d) for d in self._held])

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
        """After a Workhorse died: let every snapshot being taken complete or fail (a dead shard
        fails it at once), then finish the checkpoint being written if every writer lives, else
        abandon it (never marked complete: the previous one stays the latest)."""
        await asyncio.gather(*self._taking, return_exceptions=True)
        self._taking = []
        if self.writing is None:
            return
        try:
            await self.finish()
        except Exception as exc:  # noqa: BLE001 - a writer died with its Workhorse
            log.warning("checkpoint %s abandoned on disk: %s", self.writing.directory, str(exc).splitlines()[0])
            self.writing = None  # its snapshot stays usable from memory if it was complete

    def held_for(self, directory: Path, role: str) -> dict[str, Any] | None:
        """`role`'s snapshot files for checkpoint `directory` as `load`'s keyword arguments (their
        references, the layout they were taken in), if this run holds them (else
        None: load from disk). Any layout of the model loads them: the engine reshards."""
        held = self._held.get(Path(directory))
        if held is None or role not in held.roles:
            return None
        from xray.run.snapshot_holder import live_peer

        parallel, refs = held.roles[role]
        if role not in held.replicas or self._replicas is None:
            return {"held": refs, "saved": parallel}
        nodes, replicas = held.replicas[role]  # a rank whose node left, or that kept its file: its replica, or a live peer's file
        alive, refs, peers = self._replicas.alive(), list(refs), {}
        usable = {rank for rank, ref in enumerate(refs) if ref is not None and nodes[rank] in alive}
        for rank, copy in enumerate(replicas):
            if rank in usable:
                continue
            if copy is not None:
                refs[rank] = copy
            elif role in held.peers and (peer := live_peer(parallel, nodes, alive, rank, usable)) is not None:
                peers[rank] = peer
        return {"held": refs, "saved": parallel, **({"peers": peers} if peers else {})}

    async def materialize(self, directory: Path) -> None:
        """Have the ranks that kept their files of the snapshot of `directory` in their process
        (`Held.kept`) hand them now, where they live (a restore: the handed files of their
        position may have been lost with their node); a rank lost since adds nothing (its
        position's handed file stands in for it, `held_for`)."""
        held = self._held.get(Path(directory))
        for role, key in (held.kept if held is not None else {}).items():
            refs = held.roles[role][1]
            if all(ref is not None for ref in refs):
                continue
            try:
                got = await self.models[role].hand_kept(key)
            except Exception as exc:  # noqa: BLE001 - the handed files, or the disk, stand in
                log.warning("%s: its kept snapshot files could not be handed (%s)", role, str(exc).splitlines()[0])
                continue
            for rank, ref in got.items():
                if 0 <= rank < len(refs) and refs[rank] is None:
                    refs[rank] = ref

    def forget_after(self, step: int) -> None:
        """The run went back to `step`: the snapshots after it are of steps it will run again."""
        self._held = {d: h for d, h in self._held.items() if h.step <= step}
        newest = max(self._held.values(), key=lambda h: h.step, default=None)
        if self.in_memory is not None and self.in_memory.step > step:
            self.in_memory = newest

    def restorable(self) -> Held | None:
        """The newest complete snapshot in memory, if it holds every trained model."""
        held = self.in_memory
        if held is None or any(self.held_for(held.directory, role) is None for role in self.roles):
            return None
        return held

    def restorables(self) -> list[Held]:
        """Every complete snapshot memory holds for every trained model, newest first: a recovery
        whose newest cannot be read (a shard's node left before its replica was made) tries
        the one before (the checkpoint being written, or the latest on disk, still held)."""
        newest = self.in_memory.step if self.in_memory is not None else -1
        return sorted((h for h in self._held.values() if h.step <= newest
                       and all(self.held_for(h.directory, role) is not None for role in self.roles)),
                      key=lambda h: h.step, reverse=True)

    def _complete(self) -> float:
        w, self.writing = self.writing, None
        w.snapshots.result(), w.files.result()  # a failed copy or write of the run's own files raises here
        self.run.write_trainer_state(w.directory, w.trainer_state)
        self._on_disk = w.directory
        self._prune()
        self.run.prune_checkpoints(w.keep_last, keep=tuple(self._held))  # the snapshots memory holds stay
        seconds = self.written_s = time.perf_counter() - w.started
        log.info("checkpoint complete: %s (written in %.1f s)", w.directory, seconds)
        return seconds


def replicas_identical(model: Any) -> bool:
    """Whether `model`'s (a WholeModel) data-parallel replicas' files are alike: its engine's
    fact (`Engine.replicas_identical`), without expert parallelism."""
    from xray.config.engines import EngineError, engine

    try:
        return engine(model.init_kwargs.get("backend", "")).replicas_identical and model.parallel.ep == 1
    except EngineError:
        return False
