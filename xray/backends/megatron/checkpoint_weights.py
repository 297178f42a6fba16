"""The Hugging Face tensors of a Megatron checkpoint, read from its files alone.

Used by `python -m xray.export` (`xray/run/export.py`): no process group, no model, no GPU. A
checkpoint directory holds one file per rank (`checkpoint.py`), each with the header of the model
and layout it was written under. The full tensors are rebuilt as the engine's own export rebuilds
them (`export.py`): the same plan of entries, the same `convert.from_shards`, over the shards of
the first data-parallel replica (a routed expert from the member of its expert-parallel group that
holds it). So the result equals, bit for bit, what the run's `final/actor` holds after that step.
A LoRA checkpoint holds only the trained tensors: its adapters come out under their `peft` names.
"""
from __future__ import annotations

from pathlib import Path

import torch

from xray.backends.megatron.checkpoint import shard_path
from xray.backends.megatron.convert import Entry, from_shards
from xray.backends.megatron.export import plan_buckets
from xray.backends.megatron.lora import trained_entries
from xray.backends.megatron.spec import ModelSpec
from xray.config.lora import LoraConfig
from xray.config.parallel import ParallelDims

EVERYTHING = 1 << 62
"""A bucket size no model reaches: the export's plan in one bucket."""


def is_megatron_checkpoint(directory: str | Path) -> bool:
    return shard_path(directory, 0).is_file()


class _Files:
    """The rank files of one checkpoint, each read once, memory-mapped."""

    def __init__(self, directory: Path):
        self.directory, self._read = directory, {}

    def __getitem__(self, rank: int) -> dict:
        if rank not in self._read:
            path = shard_path(self.directory, rank)
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: the checkpoint in {self.directory} is incomplete; "
                                        "export another step")
            self._read[rank] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        return self._read[rank]


def _entries(spec: ModelSpec, parallel: ParallelDims, critic: bool, lora: LoraConfig | None) -> list[tuple[int, Entry]]:
    """(pipeline stage, entry) of every tensor the checkpoint exports, in the export's order."""
    if lora is not None:
        return [(stage, e) for stage in range(parallel.pp)
                for e in trained_entries(spec, lora, stage, parallel.pp, critic) if e.exported]
    return [(p.stage, p.entry) for bucket in plan_buckets(spec, parallel, critic, EVERYTHING) for p in bucket]


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Hugging Face name -> full tensor, of the checkpoint of one role in `directory` (the role's
    folder of a step checkpoint, holding `rank00000.pt` ...): every weight, or with LoRA the
    adapters (`peft` names) and a critic's head."""
    files = _Files(Path(directory))
    header = files[0]["header"]
    spec, parallel = ModelSpec(**header["spec"]), ParallelDims(**header["parallel"])
    saved = header.get("lora")
    lora = None if saved is None else LoraConfig(rank=saved["rank"], alpha=saved["alpha"],
                                                 target_modules=tuple(saved["targets"]))
    out: dict[str, torch.Tensor] = {}
    for stage, entry in _entries(spec, parallel, header["role"] == "critic", lora):
        dp = 0 if entry.expert is None else parallel.expert_owner(0, entry.expert, spec.num_experts)
        shards = [files[parallel.rank_of(t, stage, dp)]["model"][entry.megatron_name] for t in range(parallel.tp)]
        out.update((name, full.clone()) for name, full in zip(entry.hf_names, from_shards(entry, shards, spec)))
    return out
