"""LoRA pieces both training backends share: the seeded initial adapter, the merge, and the
`peft` adapter directory.

Sits under the training backends (`xray/backends/deepspeed`, `xray/backends/megatron/lora.py`)
and the rollout's adapter load; the settings and names come from `xray/config/lora.py`. An
adapter follows `peft`'s convention: A (r x in) starts uniform in +-1/sqrt(in) (Kaiming-uniform
with a = sqrt(5)), B (out x r) starts at zero, so a fresh adapter leaves the model unchanged; the
layer computes W x + (alpha / r) B A dropout(x).
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from xray.config.lora import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def initial_a(hf_weight: str, in_features: int, rank: int, seed: int) -> torch.Tensor:
    """The starting A (rank x in_features, fp32) of the adapter on HF weight `hf_weight`: drawn
    from a generator seeded by the run's seed and the name, so every shard and backend that
    builds it gets the same tensor."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_weight.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return torch.rand(rank, in_features, generator=g) * (2 * bound) - bound


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A, computed in fp32 and returned in W's dtype."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def save_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], lora: LoraConfig,
                 base_model: str | None = None) -> Path:
    """Write a `peft` adapter directory (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read; `tensors` carry `peft` names
    (`xray.config.lora.peft_names`)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(lora.peft_config(), base_model_name_or_path=base_model)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS))
    return out


def load_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the config of a `peft` adapter directory."""
    from safetensors.torch import load_file

    d = Path(directory)
    return load_file(str(d / ADAPTER_WEIGHTS)), json.loads((d / ADAPTER_CONFIG).read_text())
