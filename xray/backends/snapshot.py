"""Flash checkpoints on the engine side: a host-memory copy now, the disk write later.

`TrainEngine.snapshot(directory)` copies this shard's whole training state (weights, optimizer,
scheduler, RNG) into host memory, blocking, and returns a `Persist`: a function that writes
that copy to `directory`, in the very files `save(directory)` writes, and is run by the Workhorse
in a background thread while training goes on. `host_copy` is the copy; `CaptureEngine` is a
DeepSpeed checkpoint engine that takes `save_checkpoint`'s files into host memory instead of
writing them, so the DeepSpeed snapshot is DeepSpeed's own checkpoint, written later.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable

import torch

Persist = Callable[[], None]
"""Writes a snapshot to disk; run once, off the training thread."""


def host_copy(value: Any) -> Any:
    """`value` with every tensor copied into fresh host memory (containers rebuilt, the rest deep-copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping's type (OrderedDict, defaultdict)
        for k, v in value.items():
            out[k] = host_copy(v)
        return out
    if isinstance(value, list):
        return [host_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(host_copy(v) for v in value)
    return copy.deepcopy(value)


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

        def save(self, state_dict, path: str) -> None:
            self.files.append((path, host_copy(state_dict)))

        def load(self, path: str, map_location=None):
            raise RuntimeError("a capture engine only saves")

        def commit(self, info) -> bool:
            return True

    return CaptureEngine()
