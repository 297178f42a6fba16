"""Saving and loading one Megatron shard's full training state, one file per rank.

Used by `MegatronEngine.save` / `load`. A checkpoint directory holds `rank{R:05d}.pt` for every
global rank R: the shard's parameters, the AdamW state, the warm-up schedule, the step and the
RNG states (torch CPU, CUDA when on GPU, Python's `random`), plus the layout and model spec it
was written under, so that loading into a different layout fails with a clear message instead of
silently mixing shards.
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import torch


class CheckpointMismatchError(ValueError):
    """A checkpoint written under another layout, model or role than the engine loading it."""


def shard_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.pt"


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_shard(directory: str | Path, rank: int, header: dict[str, Any], state: dict[str, Any]) -> Path:
    """Write this rank's file (atomically and durably: `xray.backends.snapshot.write_atomically`)."""
    from xray.backends.snapshot import write_atomically

    path = shard_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically({"header": header, **state}, path)
    return path


def load_shard(directory: str | Path, rank: int, header: dict[str, Any], held: dict | None = None) -> dict[str, Any]:
    """Read this rank's file (from `held`, a snapshot's files, when it holds it) and check it was
    written by an engine like this one."""
    from xray.backends.snapshot import held_or_on_disk, read

    path = shard_path(directory, rank)
    if not held_or_on_disk(path, held):
        raise FileNotFoundError(f"{path} not found; was {directory} saved by a Megatron engine "
                                "with the same world size?")
    state = read(path, held, map_location="cpu", weights_only=False)
    saved = state.get("header", {})
    if saved != header:
        diff = {k: (saved.get(k), header.get(k)) for k in set(saved) | set(header)
                if saved.get(k) != header.get(k)}
        raise CheckpointMismatchError(
            f"{path} was saved by a different engine (saved vs now: {diff}); load it into an "
            "engine built with the same model, role and tp/pp/dp layout (and LoRA rank, alpha "
            "and target_modules)")
    return state


def header_in(directory: str | Path, held: dict | None = None) -> dict[str, Any] | None:
    """The header of rank 0's file in `directory` (what wrote the checkpoint; read from `held`
    when it holds the file); None without one."""
    from xray.backends.snapshot import held_or_on_disk, read

    path = shard_path(directory, 0)
    if not held_or_on_disk(path, held):
        return None
    return read(path, held, map_location="cpu", weights_only=False).get("header")


def header_of(spec, parallel, role: str, lora: dict | None = None) -> dict[str, Any]:
    """What must agree between the saving and the loading engine (`lora`: `lora.header` of a LoRA
    engine, whose checkpoint holds only the trained parameters)."""
    layout = {k: v for k, v in dataclasses.asdict(parallel).items() if k != "ep" or v != 1}  # as before ep
    fields = {k: v for k, v in dataclasses.asdict(spec).items()
              if k != "rope_scaling" or v is not None}  # plain RoPE: as before Llama 3's scaling
    out = {"spec": fields, "parallel": layout, "role": role}
    return out if lora is None else {**out, "lora": lora}
