"""Hugging Face model directories written from full weights: the export every training backend shares.

`save_hf_model(state, source_dir, target)` writes a directory that transformers and vLLM load as it
is: the weights (Hugging Face names, as `TrainEngine.export_weights` yields them) in one safetensors
file, and every other file of the source directory (`side_files`): config.json, the tokenizer with
all its pieces (tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json,
added_tokens.json, vocab/merges, tokenizer.model), generation_config.json, processor files, the
model card. Runs export their final actor with it (`xray/run/final.py`), `python -m xray.export`
a step checkpoint (`xray/run/export.py`), and `WholeModel.save_pretrained` calls it on the
exporting Workhorse.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""Files of weights: the source's are replaced by the export's own, never copied beside them."""
WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
"""The index of a sharded checkpoint: it names the source's weight files, not the export's."""
WEIGHTS_FILE = "model.safetensors"


def is_weights(name: str) -> bool:
    """Whether a file of a model directory holds weights (or indexes them)."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(WEIGHT_INDEXES)


def side_files(source_dir: str | Path) -> list[Path]:
    """Every file of `source_dir` an export carries over: all but the weights, their indexes and
    hidden files (sub-directories are not followed)."""
    return sorted(p for p in Path(source_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and not is_weights(p.name))


def save_hf_model(state: dict[str, torch.Tensor], source_dir: str | Path, target: str | Path) -> Path:
    """Write `state` (Hugging Face names) as a model directory, with every non-weight file of the
    source (its config, tokenizer, chat template, generation config: `side_files`) copied as it is."""
    from safetensors.torch import save_file

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in side_files(source_dir):
        if path.resolve() != (target / path.name).resolve():
            shutil.copy(path, target / path.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    return target
