"""Reading tensors by name from a local Hugging Face directory's safetensors files.

Used by `model.py` to fill each shard: every rank opens the files lazily and reads only the
tensors its pipeline stage needs (one or several `*.safetensors` files, with or without
`model.safetensors.index.json`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from xray.backends.expert_names import expert_part


class WeightsNotFoundError(FileNotFoundError):
    """The model directory has no safetensors weights, or lacks a tensor the model needs."""


class HFWeights:
    """Name -> tensor access to the safetensors weights of a HF model directory."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise WeightsNotFoundError(
                    f"no *.safetensors weights in {self.model_dir}; save the model with "
                    "`save_pretrained(dir, safe_serialization=True)`")
            self._file_of = {}
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    self._file_of.update({name: f for name in handle.keys()})
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of or self._fused_source(name) is not None

    def _fused_source(self, name: str) -> tuple[str, int, int | None] | None:
        """(fused tensor, expert, row half or None) holding per-expert `name` in a directory that
        stores an MoE layer's experts fused, as transformers 5's state dicts do
        (`mlp.experts.gate_up_proj` [E, 2I, H]: gate rows then up rows; `down_proj` [E, H, I])."""
        part = expert_part(name)
        if part is None or name in self._file_of or part.fused not in self._file_of:
            return None
        return part.fused, part.expert, None if part.proj == "down" else int(part.proj == "up")

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full tensor `name`, converted to `dtype` (an expert's projection cut from its layer's
        fused experts where the directory stores them so)."""
        from safetensors import safe_open

        if (source := self._fused_source(name)) is not None:
            fused, expert, half = source
            tensor = self.get(fused, dtype)[expert]
            return (tensor if half is None else tensor.chunk(2)[half]).contiguous()
        if name not in self._file_of:
            raise WeightsNotFoundError(
                f"tensor {name!r} is missing from {self.model_dir}; is it a complete "
                "checkpoint of a supported architecture (xray/backends/megatron/spec.py)?")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name).to(dtype)
