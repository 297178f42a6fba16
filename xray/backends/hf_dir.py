"""Hugging Face model directories written from full weights: the export every training backend shares.

`save_hf_model(state, source_dir, target)` writes a directory that transformers and vLLM load as it
is: the weights (Hugging Face names, as `TrainEngine.export_weights` yields them) in one safetensors
file, and the source directory's config and tokenizer files. Runs export their final actor with it,
and `WholeModel.save_pretrained` calls it on the exporting Workhorse.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json")


def save_hf_model(state: dict[str, torch.Tensor], source_dir: str | Path, target: str | Path) -> Path:
    """Write `state` (Hugging Face names) as a model directory, with the source's config and tokenizer."""
    from safetensors.torch import save_file

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, target / name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    return target
