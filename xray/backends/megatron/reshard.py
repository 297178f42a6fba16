"""Restoring a Megatron checkpoint into another tp / pp / dp layout.

`MegatronEngine.load` reads the layout a checkpoint was written under (its files' header); when it
is not the engine's, every rank rebuilds the full Hugging Face tensors of the weights and of both
AdamW moments from the first data-parallel replica's files (`convert.from_shards`: the moments
are laid out as their parameters, element for element), then cuts its own shard of each for the
new layout (`convert.to_shard`); a LoRA checkpoint holds only the trained tensors (adapters, a
critic's head), each an entry of `lora.py` split like a base tensor, and is resharded the same way.
Step, schedule and learning rates carry over unchanged; a rank with no counterpart in the old
layout takes rank 0's RNG state. Pure tensor code over files: no process group is used.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from xray.backends.megatron.checkpoint import CheckpointMismatchError, shard_path
from xray.backends.megatron.convert import Entry, from_shards, stage_entries, to_shard
from xray.backends.megatron.lora import trained_entries
from xray.backends.megatron.spec import ModelSpec
from xray.config.lora import LoraConfig
from xray.config.parallel import ParallelDims

MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpointed(spec: ModelSpec, stage: int, pp: int, critic: bool, lora: LoraConfig | None) -> list[Entry]:
    """The entries of a stage that a checkpoint holds: all, or with LoRA the trained ones (their
    `hf_names` are `peft` names for the adapters)."""
    return stage_entries(spec, stage, pp, critic) if lora is None else trained_entries(spec, lora, stage, pp, critic)


def needed_ranks(saved: ParallelDims) -> list[int]:
    """The ranks whose files `read_full` reads: the first data-parallel replica's."""
    return [saved.rank_of(t, p, 0) for p in range(saved.pp) for t in range(saved.tp)]


def read_full(directory: str | Path, spec: ModelSpec, saved: ParallelDims, critic: bool,
              lora: LoraConfig | None = None, held: dict | None = None) -> tuple[dict, dict]:
    """(HF names -> {"param": full tensors, and the moments and "step" when saved}, rank 0's file);
    the files are read from `held` (a snapshot in memory, `xray/backends/snapshot.py`) where it
    holds them, else from the disk."""
    from xray.backends.snapshot import read

    full: dict[tuple[str, ...], dict[str, Any]] = {}
    first: dict = {}
    for pp_rank in range(saved.pp):
        files = [read(shard_path(directory, saved.rank_of(t, pp_rank, 0)), held, map_location="cpu",
                      weights_only=False) for t in range(saved.tp)]
        first = first or files[0]
        order = [list(f["model"]) for f in files]  # the optimizer's parameter indices
        for entry in checkpointed(spec, pp_rank, saved.pp, critic, lora):
            if not entry.exported:
                continue
            out: dict[str, Any] = {"param": from_shards(entry, [f["model"][entry.megatron_name] for f in files], spec)}
            if "optimizer" in files[0]:
                states = [f["optimizer"]["state"].get(names.index(entry.megatron_name)) for f, names in zip(files, order)]
                if all(states):
                    out.update({m: from_shards(entry, [s[m] for s in states], spec) for m in MOMENTS})
                    out["step"] = states[0]["step"]
            full[entry.hf_names] = out
    return full, first


def shard_state(full: dict, first: dict, spec: ModelSpec, parallel: ParallelDims, rank: int, critic: bool,
                names: list[str], lora: LoraConfig | None = None) -> dict[str, Any]:
    """The state `rank` of `parallel` loads (as `checkpoint.load_shard` returns it), for parameters
    `names` in the model's order (the checkpointed ones: all, or the trained ones with LoRA)."""
    coords = parallel.coords(rank)
    entries = {e.megatron_name: e for e in checkpointed(spec, coords.pp_rank, parallel.pp, critic, lora)}
    model, moments = {}, {}
    for i, name in enumerate(names):
        entry = entries[name]
        saved = full[entry.hf_names]
        model[name] = to_shard(entry, saved["param"], spec, coords.tp_rank, parallel.tp)
        if "step" in saved:
            moments[i] = {"step": saved["step"].clone(),
                          **{m: to_shard(entry, saved[m], spec, coords.tp_rank, parallel.tp) for m in MOMENTS}}
    state = {"model": model, "step": first["step"], "rng": first["rng"]}
    if "optimizer" in first:
        groups = first["optimizer"]["param_groups"]
        if len(groups) != 1:
            raise CheckpointMismatchError(f"a checkpoint with {len(groups)} optimizer parameter groups cannot be "
                                          "resharded; load it in the layout it was saved with")
        state["optimizer"] = {"state": moments, "param_groups": [dict(groups[0], params=list(range(len(names))))]}
        state["scheduler"] = first["scheduler"]
    return state
