"""Flash checkpoints on the engine side: a host-memory copy now, the disk write later.

`TrainEngine.snapshot(directory)` copies this shard's whole training state (weights, optimizer,
scheduler, RNG) into host memory, blocking, and returns a `Snapshot`: the files `save(directory)`
would write, as objects, and a call that writes them, run by the Workhorse in a background thread
while training goes on. `host_copy` is the copy; `CaptureEngine` is a DeepSpeed checkpoint engine
that takes `save_checkpoint`'s files into host memory instead of writing them, so the DeepSpeed
snapshot is DeepSpeed's own checkpoint, written later.

The same files restore without the disk: `TrainEngine.load(directory, held)` reads a file from
`held` (path -> object, `Snapshot.held`) when it is there; `read` and `ReplayEngine` do the
reading. The Workhorse hands its snapshot's files out as a call's answer, which the object store
keeps for the caller after the Workhorse dies (`xray/run/checkpoints.py`).
"""
from __future__ import annotations

import copy
import mmap
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


def file_key(path: str | os.PathLike) -> str:
    """One spelling of a checkpoint file's path, for `held` lookups."""
    return os.path.normpath(os.path.abspath(os.fspath(path)))


@dataclass
class Snapshot:
    """A shard's state in host memory as the files of its checkpoint; calling it writes them."""

    files: list[tuple[str, Any]]
    """(path, object): each written with torch.save, atomically (`write_atomically`)."""
    finish: Optional[Callable[[], None]] = None
    """Run once every file is written (DeepSpeed's `latest` marker)."""
    markers: Optional[dict[str, Any]] = None
    """Path -> content of what `finish` writes, for `held` (a load from memory reads them there)."""
    taken_as: Optional[int] = None
    """The rank of the shard that took it (`TrainWorkhorse.snapshot`: a survivor's may change after)."""

    def __call__(self) -> None:
        for path, state in self.files:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write_atomically(state, path)
        if self.finish is not None:
            self.finish()

    def held(self) -> dict[str, Any]:
        """The files by `file_key`: what `TrainEngine.load(directory, held)` reads instead of the disk."""
        return {**{file_key(path): value for path, value in (self.markers or {}).items()},
                **{file_key(path): state for path, state in self.files}}


def held_or_on_disk(path: str | os.PathLike, held: dict[str, Any] | None) -> bool:
    """Whether the checkpoint file at `path` is in `held` (a snapshot's files) or on the disk."""
    return (held is not None and file_key(path) in held) or os.path.isfile(path)


def stage_held(directory: str, held: dict[str, Any], staged: str) -> str:
    """Write `held`'s files under `directory` into `staged`, at the same relative paths (a marker,
    a str, as text); returns `staged`, to load from where a reader globs the disk (DeepSpeed)."""
    root = file_key(directory)
    for key, value in held.items():
        if not key.startswith(root + os.sep):
            continue
        path = os.path.join(staged, os.path.relpath(key, root))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(value, str):
            with open(path, "w") as f:
                f.write(value)
        else:
            torch.save(value, path)
    return staged


def read(path: str | os.PathLike, held: dict[str, Any] | None = None, **load_options) -> Any:
    """The checkpoint file at `path`: from `held` when it holds it, else torch.load."""
    if held is not None and (key := file_key(path)) in held:
        return held[key]
    return torch.load(path, **load_options)


BLOCK_ALIGN = 64
"""Bytes each tensor's place in a `host_copy` block is aligned to (any dtype's view is valid)."""


def host_copy(value: Any) -> Any:
    """`value` with every tensor copied into fresh host memory, all of them into one block
    (containers rebuilt, the rest deep-copied): one anonymous memory map of its own, not the
    heap's, unmapped (back to the system) when the last of its tensors goes: no `malloc_trim`
    needed after a snapshot is handed out (glibc kept freed copies in the heap, an 800 MB one
    whole in a Ray worker, measured), and no call to run it."""
    tensors: list[torch.Tensor] = []

    def found(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif isinstance(v, (dict, list)) or type(v) is tuple:
            _rebuilt(v, found)
        return v

    found(value)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)  # the map is unmapped with its last tensor
        total += -(-t.numel() * t.element_size() // BLOCK_ALIGN) * BLOCK_ALIGN
    block = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    places = iter(zip(tensors, offsets))

    def placed(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t, offset = next(places)
            out = block[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            out.copy_(t.detach())
            return out
        if isinstance(v, (dict, list)) or type(v) is tuple:
            return _rebuilt(v, placed)
        return copy.deepcopy(v)
    return placed(value)


@dataclass(frozen=True)
class WireTensor:
    """A tensor as a numpy array (its bytes; a dtype numpy lacks, such as bfloat16, viewed as the
    integer of its width) and its torch dtype: what Ray's object store holds without copying on
    either side (a reader's `ray.get` maps it, and so pins its node's copy while the value lives)."""

    array: Any
    dtype: str


def to_wire(value: Any) -> Any:
    """`value` with every tensor a `WireTensor` (containers rebuilt; the arrays share the tensors' memory)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        try:
            array = t.numpy()
        except TypeError:  # no numpy dtype (bfloat16, float8): its bytes, as an integer of its width
            array = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
        return WireTensor(array, str(t.dtype).removeprefix("torch."))
    return _rebuilt(value, to_wire)


def from_wire(value: Any, copy: bool = True) -> Any:
    """`to_wire`'s inverse: every `WireTensor` a tensor in fresh, writable memory, or with
    `copy=False` one over the array's own memory (read-only where Ray mapped it: to be written to
    disk, not trained)."""
    if isinstance(value, WireTensor):
        import warnings

        import numpy as np

        with warnings.catch_warnings():  # from_numpy warns of a read-only array; nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(np.array(value.array, copy=True) if copy else value.array)
        dtype = getattr(torch, value.dtype)
        return tensor if tensor.dtype == dtype else tensor.view(dtype)
    return _rebuilt(value, lambda v: from_wire(v, copy))


def _rebuilt(value: Any, each: Callable[[Any], Any]) -> Any:
    """A dict, list or tuple rebuilt with `each` applied to its items (a mapping keeps its type:
    OrderedDict, defaultdict); anything else as it is."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = each(v)
        return out
    if isinstance(value, list):
        return [each(v) for v in value]
    if type(value) is tuple:
        return tuple(each(v) for v in value)
    return value


def write_atomically(state: Any, path: str | os.PathLike) -> None:
    """torch.save to a temporary name, flushed to the disk, then renamed (and the rename flushed):
    a crash leaves either no file or the whole file under `path`, never half of one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def capture_engine():
    """A DeepSpeed `CheckpointEngine` that keeps what `save_checkpoint` saves, as host copies, in
    `.files` ([(path, state)]), and writes nothing (DeepSpeed imported only when asked)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class CaptureEngine(CheckpointEngine):
        def __init__(self) -> None:
            super().__init__(None)
            self.files: list[tuple[str, Any]] = []

        def create(self, info) -> None:
            pass

        def makedirs(self, path, exist_ok=False) -> None:
            pass  # the write makes them (`Snapshot.__call__`); a snapshot kept in memory makes none

        def save(self, state_dict, path: str) -> None:
            self.files.append((path, host_copy(state_dict)))

        def load(self, path: str, map_location=None):
            raise RuntimeError("a capture engine only saves")

        def commit(self, info) -> bool:
            return True

    return CaptureEngine()


def replay_engine(held: dict[str, Any]):
    """A DeepSpeed `CheckpointEngine` whose loads come from `held` (a snapshot's files) when it
    holds them, else from the disk; it saves nothing."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class ReplayEngine(CheckpointEngine):
        def __init__(self) -> None:
            super().__init__(None)

        def create(self, info) -> None:
            pass

        def save(self, state_dict, path: str) -> None:
            raise RuntimeError("a replay engine only loads")

        def load(self, path: str, map_location=None):
            return read(path, held, map_location=map_location, weights_only=False)

        def commit(self, info) -> bool:
            return True

    return ReplayEngine()
