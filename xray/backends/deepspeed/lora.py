"""LoRA adapters on the DeepSpeed backend's modules, through the `peft` library.

Sits inside the DeepSpeed training backend: `load_model` calls `add_adapters` on the Hugging
Face module (or the critic's trunk) before DeepSpeed wraps it, so ZeRO 1-3 shard the adapters like
any parameter and only they train (the base weights are frozen and hold no optimizer state). The
adapters start as `xray/backends/lora.py` says (seeded A, zero B: the same start as the Megatron
backend's). peft names a wrapped layer's weights `<module>.base_layer.weight`,
`<module>.lora_A.default.weight` and `<module>.lora_B.default.weight`; `hf_units` maps them back
to the Hugging Face tensors they make, for the merged export, and `peft_name` to the names of a
`peft` adapter directory.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from xray.backends.lora import initial_a
from xray.config.lora import PEFT_PREFIX, LoraConfig

ADAPTER = "default"  # peft's name for the one adapter


def add_adapters(module: torch.nn.Module, lora: LoraConfig, seed: int) -> torch.nn.Module:
    """Wrap `module`'s target linear layers with LoRA adapters (in place) and freeze everything
    else but a critic's value head. Returns the module."""
    import peft
    from peft.tuners.lora import LoraLayer

    options = {k: v for k, v in lora.peft_config().items() if k not in ("peft_type", "task_type")}
    peft.inject_adapter_in_model(peft.LoraConfig(**options), module, adapter_name=ADAPTER)
    with torch.no_grad():
        for name, layer in module.named_modules():
            if isinstance(layer, LoraLayer):
                a = layer.lora_A[ADAPTER].weight
                a.copy_(initial_a(f"{name}.weight", a.shape[1], lora.rank, seed).to(a.dtype))
                layer.lora_B[ADAPTER].weight.zero_()
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name) or name.startswith("value_head."))
    return module


def is_adapter(name: str) -> bool:
    """Whether parameter `name` belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module) -> Iterator[None]:
    """Compute with every adapter of `module` off (the frozen base model) inside the block. Sets
    peft's flag directly: its `enable_adapters` also flips requires_grad, which must not change
    under a DeepSpeed engine."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def hf_units(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """Each Hugging Face tensor of the module with the parameters that make it: [weight] for an
    unwrapped one, [base weight, A, B] for an adapted linear weight (merge: W + scaling B A), in
    the module's order."""
    units: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in named:
        if is_adapter(name):
            module = name.split(".lora_")[0]
            units[f"{module}.weight"].append(param)
        else:
            units[name.replace(".base_layer.", ".")] = [param]
    return list(units.items())


def peft_name(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` -> the `peft` adapter file's
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")
