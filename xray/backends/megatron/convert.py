"""Weight layout between Hugging Face and Megatron-core: which HF tensors make each Megatron shard.

Second step of `xray.backends.megatron`, after `spec`: `stage_entries` lists, for one pipeline
stage, every Megatron parameter with the HF tensors it is made of and how (`Kind`);
`to_shard` builds one tensor-parallel shard from full HF tensors (used when loading) and
`from_shards` rebuilds the full HF tensors from all shards (used by the export). Pure tensor code:
no process groups, so it is tested bitwise in one process.

Megatron layouts (per tensor-parallel rank r of tp):
- fused QKV: for each key/value group g of this rank, the rows [q heads of g; k of g; v of g];
- fused gate/up (`linear_fc1`): [gate rows of r; up rows of r];
- column-parallel (embedding, output layer): rows split in tp equal parts;
- row-parallel (attention output, `linear_fc2`): columns split in tp equal parts;
- replicated (norms, Qwen3's per-head q/k norms, the value head): whole on every rank;
- a routed expert (`Entry.expert`): on one member of each expert-parallel group only, as local
  expert `e % (experts / ep)` of the member `e // (experts / ep)` (`ParallelDims.ep`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from xray.backends.megatron.spec import ModelSpec, stage_layers

VALUE_HEAD = "score.weight"  # the critic's scalar head, as HF's *ForTokenClassification names it


class Kind(enum.Enum):
    """How one Megatron parameter is made of HF tensors."""

    REPLICATED = "replicated"  # the same full tensor on every tp rank (norms, the value head)
    COLUMN = "column"          # rows split over tp
    ROW = "row"                # columns split over tp
    QKV = "qkv"                # q, k, v fused per key/value group, groups split over tp
    GATE_UP = "gate_up"        # gate and up fused per tp rank


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter of a pipeline stage and the HF tensors it holds."""

    megatron_name: str
    """Name in the stage's GPTModel (`named_parameters`)."""
    hf_names: tuple[str, ...]
    """HF tensors it is made of, in fusion order (q, k, v / gate, up)."""
    kind: Kind
    """How the HF tensors map onto it."""
    exported: bool = True
    """False for a duplicate (the tied output layer on the last stage); the owner exports it."""
    tp_partial: bool = False
    """A replicated weight applied to each rank's own heads (Qwen3's q/k norms): each tp rank's
    gradient is a partial sum, summed over the tp group before the step."""
    expert: int | None = None
    """The routed expert's index in its layer (its weights live on one expert-parallel rank)."""


def expert_rank(spec: ModelSpec, expert: int, ep: int) -> int:
    """The expert-parallel rank holding `expert` of each MoE layer."""
    return expert // (spec.num_experts // ep)


def _layer_entries(spec: ModelSpec, local: int, layer: int, ep: int = 1, ep_rank: int | None = None) -> list[Entry]:
    m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
    attn = h + "self_attn."
    out = [Entry(m + "input_layernorm.weight", (h + "input_layernorm.weight",), Kind.REPLICATED),
           Entry(m + "self_attention.linear_qkv.weight",
                 tuple(attn + f"{p}_proj.weight" for p in "qkv"), Kind.QKV)]
    if spec.qkv_bias:
        out.append(Entry(m + "self_attention.linear_qkv.bias",
                         tuple(attn + f"{p}_proj.bias" for p in "qkv"), Kind.QKV))
    if spec.qk_norm:  # [head_dim], the same on every rank, applied to the rank's heads
        out += [Entry(m + f"self_attention.{p}_layernorm.weight", (attn + f"{p}_norm.weight",), Kind.REPLICATED,
                      tp_partial=True) for p in "qk"]
    out += [Entry(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), Kind.ROW),
            Entry(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",),
                  Kind.REPLICATED)]
    if spec.num_experts:  # the router, then each expert's SwiGLU under its per-expert HF names
        out.append(Entry(m + "mlp.router.weight", (h + "mlp.gate.weight",), Kind.REPLICATED))
        per_rank = spec.num_experts // ep
        for e in range(spec.num_experts):
            if ep_rank is not None and expert_rank(spec, e, ep) != ep_rank:
                continue
            mine, theirs = f"{m}mlp.experts.local_experts.{e % per_rank}.", f"{h}mlp.experts.{e}."
            out += [Entry(mine + "linear_fc1.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
                          Kind.GATE_UP, expert=e),
                    Entry(mine + "linear_fc2.weight", (theirs + "down_proj.weight",), Kind.ROW, expert=e)]
        if spec.shared_expert_intermediate_size:  # Qwen2-MoE's, on every token, and its sigmoid gate
            mine, theirs = f"{m}mlp.shared_experts.", f"{h}mlp.shared_expert."
            out += [Entry(mine + "linear_fc1.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"),
                          Kind.GATE_UP),
                    Entry(mine + "linear_fc2.weight", (theirs + "down_proj.weight",), Kind.ROW),
                    Entry(mine + "gate_weight", (h + "mlp.shared_expert_gate.weight",), Kind.REPLICATED)]
        return out
    out += [Entry(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                  Kind.GATE_UP),
            Entry(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), Kind.ROW)]
    return out


def stage_entries(spec: ModelSpec, pp_rank: int, pp: int, critic: bool = False, ep: int = 1,
                  ep_rank: int | None = None) -> list[Entry]:
    """Every parameter of pipeline stage `pp_rank`, in a fixed order shared by all ranks; with
    `ep_rank`, the routed experts of that expert-parallel rank only (of `ep`), else all of them
    (each under its local name on its own rank)."""
    entries: list[Entry] = []
    if pp_rank == 0:
        entries.append(Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                             Kind.COLUMN))
    for local, layer in enumerate(stage_layers(spec.num_layers, pp)[pp_rank]):
        entries += _layer_entries(spec, local, layer, ep, ep_rank)
    if pp_rank == pp - 1:
        entries.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED))
        if critic:
            entries.append(Entry("output_layer.weight", (VALUE_HEAD,), Kind.REPLICATED))
        elif not spec.tie_word_embeddings:
            entries.append(Entry("output_layer.weight", ("lm_head.weight",), Kind.COLUMN))
        elif pp > 1:  # a copy of the tied embedding on the last stage, kept in sync by Megatron
            entries.append(Entry("output_layer.weight", ("model.embed_tokens.weight",), Kind.COLUMN,
                                 exported=False))
    return entries


def _qkv_groups(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[groups, (heads_per_group + 2) * head_dim, ...]: the fused layout of all groups."""
    g, rest = spec.num_kv_heads, q.shape[1:]
    return torch.cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], dim=1)


def to_shard(entry: Entry, hf: list[torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """The tp_rank-th shard of `entry` from its full HF tensors (in `entry.hf_names` order)."""
    if entry.kind is Kind.REPLICATED:
        return hf[0].clone()
    if entry.kind is Kind.COLUMN:
        return hf[0].chunk(tp, dim=0)[tp_rank].clone()
    if entry.kind is Kind.ROW:
        return hf[0].chunk(tp, dim=1)[tp_rank].clone()
    if entry.kind is Kind.QKV:
        fused = _qkv_groups(spec, *hf).chunk(tp, dim=0)[tp_rank]
        return fused.reshape(-1, *fused.shape[2:]).clone()
    if entry.kind is Kind.GATE_UP:
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    raise AssertionError(entry.kind)


def from_shards(entry: Entry, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The full HF tensors of `entry` (in `entry.hf_names` order) from its shards in tp order."""
    if entry.kind is Kind.REPLICATED:
        return [shards[0]]
    if entry.kind is Kind.COLUMN:
        return [torch.cat(shards, dim=0)]
    if entry.kind is Kind.ROW:
        return [torch.cat(shards, dim=1)]
    if entry.kind is Kind.QKV:
        rest = shards[0].shape[1:]
        d, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
        fused = torch.cat(shards, dim=0).reshape(spec.num_kv_heads, -1, *rest)
        q, k, v = fused.split([per_group * d, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]
    if entry.kind is Kind.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(entry.kind)


def shard_shape(entry: Entry, spec: ModelSpec, tp: int) -> tuple[int, ...]:
    """The shape of one tp shard of `entry`, known to every rank without the model."""
    h, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d // tp
    name = entry.megatron_name
    inner = spec.moe_intermediate_size if ".local_experts." in name else \
        spec.shared_expert_intermediate_size if ".shared_experts." in name else spec.intermediate_size
    if entry.kind is Kind.REPLICATED:
        if name.endswith("mlp.router.weight"):
            return (spec.num_experts, h)
        if name.endswith("shared_experts.gate_weight"):
            return (1, h)
        return (1, h) if entry.hf_names == (VALUE_HEAD,) else (d,) if entry.tp_partial else (h,)
    if entry.kind is Kind.COLUMN:
        return (spec.vocab_size // tp, h)
    if entry.kind is Kind.QKV:
        return (qkv_rows,) if name.endswith("bias") else (qkv_rows, h)
    if entry.kind is Kind.GATE_UP:
        return (2 * inner // tp, h)
    if name.endswith("linear_proj.weight"):
        return (h, spec.num_heads * d // tp)
    return (h, inner // tp)  # linear_fc2
