"""How Hugging Face names a mixture of experts' tensors, shared by the engines that read, send or
receive them (`xray/backends/megatron/hf_weights.py`, both training engines' exports,
`xray/backends/vllm_moe.py`), and how an export cuts its buckets so that a block's tensors travel
together (`bucketed`: the rollout engine can reload an MoE block only once it holds all of it).

transformers 5 holds a layer's experts fused in its state dicts (`<layer>.mlp.experts.gate_up_proj`
[E, 2I, H], each expert's gate rows then its up rows; `<layer>.mlp.experts.down_proj` [E, H, I])
and saves them one tensor per expert and projection (`<layer>.mlp.experts.<e>.gate_proj.weight`).
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple, TypeVar

import torch

T = TypeVar("T")

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
    def name(self) -> str:
        """Its per-expert tensor name (`...experts.<e>.<proj>_proj.weight`)."""
        return f"{self.experts}.{self.expert}.{self.proj}_proj.weight"

    @property
    def fused(self) -> str:
        """The fused tensor holding it (`...experts.gate_up_proj` or `...experts.down_proj`)."""
        return f"{self.experts}.{'down_proj' if self.proj == 'down' else 'gate_up_proj'}"


def expert_part(name: str) -> ExpertPart | None:
    """The expert, projection and fused tensor of a per-expert name; None for any other name."""
    m = _PER_EXPERT.match(name)
    return ExpertPart(m.group(1), int(m.group(2)), m.group(3)) if m else None


def moe_block_of(name: str) -> str | None:
    """`model.layers.i.mlp` for a tensor of an MoE block (router, experts, shared expert and its
    gate); None for any other tensor."""
    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight") or ".mlp.shared_expert" in name:
        return name[:name.index(".mlp.") + len(".mlp")]
    return None


def bucketed(items: list[T], name: Callable[[T], str], nbytes: Callable[[T], int], bucket_bytes: int) -> list[list[T]]:
    """`items` (in order) in consecutive buckets of at most `bucket_bytes`, an MoE block's tensors
    (`moe_block_of` their Hugging Face `name`) never cut apart: a block or tensor larger than a
    bucket goes in one of its own."""
    units: list[list[T]] = []
    for item in items:
        block = moe_block_of(name(item))
        if block is not None and units and moe_block_of(name(units[-1][0])) == block:
            units[-1].append(item)
        else:
            units.append([item])
    buckets: list[list[T]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(nbytes(i) for i in unit)
        if not buckets or (buckets[-1] and size + unit_bytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].extend(unit)
        size += unit_bytes
    return buckets


def expert_view(fused: torch.Tensor, part: ExpertPart) -> torch.Tensor:
    """The view of a layer's fused experts (`gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I]) that
    holds `part`, the tensor of one expert and projection (gate: the first I rows, up: the next)."""
    one = fused[part.expert]
    if part.proj == "down":
        return one
    inner = one.shape[0] // 2
    return one[:inner] if part.proj == "gate" else one[inner:]


def fused_parts(fused_name: str, num_experts: int) -> list[ExpertPart]:
    """Every per-expert tensor a fused experts tensor (`...experts.gate_up_proj` or `down_proj`) holds."""
    experts = fused_name.rsplit(".", 1)[0]
    projs = ("down",) if fused_name.endswith("down_proj") else ("gate", "up")
    return [ExpertPart(experts, e, p) for e in range(num_experts) for p in projs]
