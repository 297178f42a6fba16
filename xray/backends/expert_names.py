"""How Hugging Face names a mixture of experts' tensors, shared by the engines that read or
receive them (`xray/backends/megatron/hf_weights.py`, `xray/backends/vllm_moe.py`).

transformers 5 holds a layer's experts fused in its state dicts (`<layer>.mlp.experts.gate_up_proj`
[E, 2I, H], each expert's gate rows then its up rows; `<layer>.mlp.experts.down_proj` [E, H, I])
and saves them one tensor per expert and projection (`<layer>.mlp.experts.<e>.gate_proj.weight`).
"""
from __future__ import annotations

import re
from typing import NamedTuple

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class ExpertPart(NamedTuple):
    """One per-expert tensor's place in its layer's fused experts."""

    experts: str
    """The layer's experts' prefix (`model.layers.3.mlp.experts`)."""
    expert: int
    """The expert's index."""
    proj: str
    """`gate`, `up` or `down`."""

    @property
    def fused(self) -> str:
        """The fused tensor holding it (`...experts.gate_up_proj` or `...experts.down_proj`)."""
        return f"{self.experts}.{'down_proj' if self.proj == 'down' else 'gate_up_proj'}"


def expert_part(name: str) -> ExpertPart | None:
    """The expert, projection and fused tensor of a per-expert name; None for any other name."""
    m = _PER_EXPERT.match(name)
    return ExpertPart(m.group(1), int(m.group(2)), m.group(3)) if m else None
