"""LoRA settings of a trained role (`actor.lora`, `critic.lora`) and the names they resolve to.

Sits in the config layer: the typed section both training backends read (DeepSpeed through the
`peft` library, Megatron through `xray/backends/megatron/lora.py`), and the pure helpers that
give the Hugging Face module names an adapter wraps and the `peft` names its tensors carry, so
that every backend writes the same `peft` adapter directory. Nothing here imports `peft`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

# The linear layers of a Llama / Qwen2 decoder layer, as Hugging Face names them. `all-linear`
# means these, as in `peft` (which leaves the output layer out).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the prefix `peft` puts before a Hugging Face parameter name in an adapter's state dict
PEFT_PREFIX = "base_model.model."


class LoraConfigError(ValueError):
    """A LoRA setting that cannot be used; the message says the fix."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the role's linear layers (LoRA); only they train and hold optimizer
    state, the base weights stay frozen."""

    rank: int = 8
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: Union[str, tuple[str, ...]] = "all-linear"
    """`all-linear` (every linear layer of the decoder layers: q/k/v/o and gate/up/down
    projections) or a list of those Hugging Face module names."""
    export_merged: bool = False
    """At the end of a run, also write the merged model (W + alpha/r B A) as a Hugging Face
    directory `final/actor` beside the `peft` adapter directory `final/adapter`."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise LoraConfigError(f"lora.rank={self.rank}; give a rank >= 1 (8 is usual)")
        if not self.alpha > 0:
            raise LoraConfigError(f"lora.alpha={self.alpha}; give a positive alpha (2-4 x rank is usual)")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"lora.dropout={self.dropout}; give a value in [0, 1)")
        self.targets()  # raises on an unknown name

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output: alpha / rank."""
        return self.alpha / self.rank

    def targets(self) -> tuple[str, ...]:
        """The Hugging Face module names the adapters wrap, in `ALL_LINEAR`'s order."""
        if isinstance(self.target_modules, str):
            if self.target_modules == "all-linear":
                return ALL_LINEAR
            names: tuple[str, ...] = (self.target_modules,)
        else:
            names = tuple(self.target_modules)
        unknown = [n for n in names if n not in ALL_LINEAR]
        if unknown or not names:
            raise LoraConfigError(f"lora.target_modules={self.target_modules!r}: {unknown or 'empty'} "
                                  f"not among {', '.join(ALL_LINEAR)}; give 'all-linear' or a list of those")
        return tuple(n for n in ALL_LINEAR if n in names)

    def peft_config(self) -> dict:
        """The `adapter_config.json` of a `peft` LoRA adapter with these settings (a plain dict:
        `peft.LoraConfig(**it)` builds the same adapter)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": list(self.targets()), "bias": "none",
                "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True}


def peft_names(hf_weight: str) -> tuple[str, str]:
    """The `peft` state-dict names (lora_A, lora_B) of the adapter on the HF linear weight
    `hf_weight` (`model.layers.0.self_attn.q_proj.weight`)."""
    if not hf_weight.endswith(".weight"):
        raise ValueError(f"{hf_weight!r} is not a weight name")
    module = PEFT_PREFIX + hf_weight.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def adapted_weights(hf_names: list[str], lora: LoraConfig) -> list[str]:
    """The HF linear weights among `hf_names` that carry an adapter under `lora`."""
    targets = set(lora.targets())
    return [n for n in hf_names if n.endswith(".weight") and n.split(".")[-2] in targets
            and ".layers." in n]
