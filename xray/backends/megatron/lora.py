"""LoRA adapters on Megatron-core's parallel linear layers: sharded as Megatron shards the layer,
named as `peft` names the adapter.

Used by the Megatron engine (`engine.py`) when its role has `lora` settings; megatron-core has no
LoRA of its own (FACTS.md). After `model.py` has built and filled a shard and frozen it, `attach`
hangs a `ParallelLoRA` under each adapted linear layer (as its child `lora`, so the base
parameters keep their names) with a forward hook that adds the adapter's output to the layer's.
The layer computes W x + (alpha / r) B A dropout(x), one (A, B) per Hugging Face module, as `peft`
puts them on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj.

Layouts (tensor-parallel rank r of tp; `convert.py` lays the base weights out the same way):
- column-parallel layers (`linear_qkv`: q, k, v; `linear_fc1`: gate, up): each part's A is whole
  on every rank (its gradient is summed over the ranks: Megatron's
  `copy_to_tensor_model_parallel_region` on A's output), each part's B holds this rank's rows of
  that part, and the parts' outputs are fused as the base output is (q/k/v per key/value group,
  then gate/up);
- row-parallel layers (`linear_proj`: o; `linear_fc2`: down): A holds this rank's columns, its
  output is all-reduced (`reduce_from_tensor_model_parallel_region`), B is whole on every rank.
Every adapter tensor is described by a `convert.Entry` whose `hf_names` is its `peft` name and
whose kind says how it is split (REPLICATED, COLUMN: rows, ROW: columns), so export, checkpoints
and resharding treat it like any base parameter (`convert.to_shard` / `from_shards`).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from xray.backends.lora import initial_a
from xray.backends.megatron.convert import VALUE_HEAD, Entry, Kind, stage_entries
from xray.backends.megatron.spec import ModelSpec
from xray.config.lora import PEFT_PREFIX, LoraConfig, adapted_weights, peft_names

# how each matrix of an adapter is split over tensor parallelism, per kind of base layer
_SPLITS = {Kind.QKV: (Kind.REPLICATED, Kind.COLUMN), Kind.GATE_UP: (Kind.REPLICATED, Kind.COLUMN),
           Kind.ROW: (Kind.ROW, Kind.REPLICATED)}


def _module(hf_weight: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `q_proj`."""
    return hf_weight.split(".")[-2]


def hf_weight_of(peft_name: str) -> str:
    """The HF weight an adapter tensor belongs to: `base_model.model.X.lora_A.weight` -> `X.weight`."""
    module = peft_name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0]
    return f"{module}.weight"


def hf_shape(spec: ModelSpec, hf_weight: str) -> tuple[int, int]:
    """(out, in) of one adapted HF linear weight."""
    h, q, kv, inter = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}[_module(hf_weight)]


def full_shape(entry: Entry, spec: ModelSpec, lora: LoraConfig) -> tuple[int, int]:
    """The whole (unsharded) shape of an adapter tensor: A is rank x in, B is out x rank."""
    out, inp = hf_shape(spec, hf_weight_of(entry.hf_names[0]))
    return (lora.rank, inp) if ".lora_A." in entry.megatron_name else (out, lora.rank)


def local_shape(entry: Entry, spec: ModelSpec, lora: LoraConfig, tp: int) -> tuple[int, int]:
    """The shape of one tensor-parallel shard of an adapter tensor."""
    rows, cols = full_shape(entry, spec, lora)
    if entry.kind is Kind.COLUMN:
        return rows // tp, cols
    if entry.kind is Kind.ROW:
        return rows, cols // tp
    return rows, cols


def _adapted(spec: ModelSpec, lora: LoraConfig, stage: int, pp: int) -> Iterator[tuple[Entry, list[str]]]:
    """The stage's base linear weights that carry adapters, with their adapted HF parts."""
    for entry in stage_entries(spec, stage, pp):
        if entry.kind in _SPLITS and entry.megatron_name.endswith(".weight"):
            parts = adapted_weights(list(entry.hf_names), lora)
            if parts:
                yield entry, parts


def lora_entries(spec: ModelSpec, lora: LoraConfig, stage: int, pp: int) -> list[Entry]:
    """Every adapter tensor of pipeline stage `stage`, in a fixed order shared by all ranks."""
    out = []
    for base, parts in _adapted(spec, lora, stage, pp):
        layer = base.megatron_name.removesuffix(".weight")
        split_a, split_b = _SPLITS[base.kind]
        for matrix, split in (("A", split_a), ("B", split_b)):
            for hf in parts:
                name = peft_names(hf)[0 if matrix == "A" else 1]
                out.append(Entry(f"{layer}.lora.lora_{matrix}.{_module(hf)}", (name,), split))
    return out


def fuse(pieces: list[torch.Tensor], kind: Kind, groups: int, dim: int) -> torch.Tensor:
    """The parts' tensors (each holding this rank's rows of its part along `dim`) laid out as
    Megatron fuses the base layer's rows: per key/value group [q; k; v] for QKV (`groups`: the
    groups on this rank), [gate; up] for gate/up."""
    if kind is not Kind.QKV:
        return torch.cat(pieces, dim)
    last = [p.movedim(dim, -1).unflatten(-1, (groups, -1)) for p in pieces]
    return torch.cat(last, dim=-1).flatten(-2).movedim(-1, dim)


class ParallelLoRA(torch.nn.Module):
    """The adapters on one parallel linear layer, one (A, B) per adapted HF part, this rank's shard.

    `parts` are the layer's HF weight names in fusion order; those outside `adapted` get no
    adapter (their rows of the output get nothing added)."""

    def __init__(self, kind: Kind, parts: tuple[str, ...], adapted: list[str], spec: ModelSpec,
                 lora: LoraConfig, tp_rank: int, tp: int, seed: int, dtype: torch.dtype):
        super().__init__()
        self.kind, self.tp_rank, self.tp = kind, tp_rank, tp
        self.parts = [_module(p) for p in parts]
        self.rows = {_module(p): hf_shape(spec, p)[0] // (1 if kind is Kind.ROW else tp) for p in parts}
        self.groups = spec.num_kv_heads // tp
        self.scaling, self.p = lora.scaling, lora.dropout
        self.enabled = True
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        split_a, split_b = _SPLITS[kind]
        for hf in adapted:
            out, inp = hf_shape(spec, hf)
            a = initial_a(hf, inp, lora.rank, seed)
            a = a.chunk(tp, dim=1)[tp_rank] if split_a is Kind.ROW else a
            b = torch.zeros(out // tp if split_b is Kind.COLUMN else out, lora.rank)
            self.lora_A[_module(hf)] = _parameter(a.to(dtype).contiguous(), split_a, tp)
            self.lora_B[_module(hf)] = _parameter(b.to(dtype), split_b, tp)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.kind is not Kind.ROW:  # x is whole and the RNG state the same on every tp rank
            return F.dropout(x, self.p, training=True)
        # x holds this rank's columns: draw the whole input's mask (the same on every rank) and
        # keep this rank's columns, as an unsharded layer would draw it
        shape = (*x.shape[:-1], x.shape[-1] * self.tp)
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.p)
        return x * keep.chunk(self.tp, dim=-1)[self.tp_rank] / (1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the base layer's output for its input `x` [s, b, in(/tp)]."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        if self.kind is Kind.ROW:
            (part,) = self.parts
            u = reduce_from_tensor_model_parallel_region(F.linear(self._dropout(x), self.lora_A[part]))
            return F.linear(u, self.lora_B[part]) * self.scaling
        pieces = []
        for part in self.parts:
            if part not in self.lora_A:
                pieces.append(x.new_zeros(*x.shape[:-1], self.rows[part]))
                continue
            u = copy_to_tensor_model_parallel_region(F.linear(self._dropout(x), self.lora_A[part]))
            pieces.append(F.linear(u, self.lora_B[part]))
        return fuse(pieces, self.kind, self.groups, dim=-1) * self.scaling

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + scaling * B A (as `xray.backends.lora.merge`: fp32, then W's dtype)."""
        deltas = []
        for part in self.parts:
            if part in self.lora_A:
                deltas.append(self.lora_B[part].float() @ self.lora_A[part].float())
            else:
                deltas.append(weight.new_zeros(self.rows[part], weight.shape[1], dtype=torch.float32))
        delta = deltas[0] if self.kind is Kind.ROW else fuse(deltas, self.kind, self.groups, dim=0)
        return (weight.float() + self.scaling * delta).to(weight.dtype)


def _parameter(value: torch.Tensor, split: Kind, tp: int) -> torch.nn.Parameter:
    """A trainable adapter tensor with Megatron's tensor-parallel attributes (Megatron counts a
    tensor without `tensor_model_parallel` in the gradient norm on tp rank 0 only)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    param = torch.nn.Parameter(value)
    split_dim = {Kind.COLUMN: 0, Kind.ROW: 1}.get(split, -1)
    set_tensor_model_parallel_attributes(param, tp > 1 and split_dim >= 0, split_dim, 1)
    return param


def _add_adapter(layer: torch.nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of an adapted Megatron linear layer: (out, bias) -> (out + adapter(x), bias)."""
    if not layer.lora.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + layer.lora(x).to(out.dtype), bias


def attach(model: torch.nn.Module, spec: ModelSpec, lora: LoraConfig, stage: int, pp: int,
           tp_rank: int, tp: int, seed: int) -> list[Entry]:
    """Put adapters on this shard's adapted linear layers (base weights must be frozen already);
    A starts as `initial_a` of its HF weight (sliced where split), B at zero. Returns the
    adapter tensors' entries (`lora_entries`)."""
    if getattr(model.config, "sequence_parallel", False):
        raise NotImplementedError("LoRA adapters assume sequence_parallel=False (the engine's setting)")
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    for base, parts in _adapted(spec, lora, stage, pp):
        layer = modules[base.megatron_name.removesuffix(".weight")]
        layer.lora = ParallelLoRA(base.kind, base.hf_names, parts, spec, lora, tp_rank, tp, seed, dtype)
        layer.register_forward_hook(_add_adapter, with_kwargs=True)
    entries = lora_entries(spec, lora, stage, pp)
    params = dict(model.named_parameters())
    assert all(e.megatron_name in params for e in entries), "adapter names out of step with lora_entries"
    return entries


def adapters(model: torch.nn.Module) -> dict[str, ParallelLoRA]:
    """The adapted layers' names (`decoder.layers.0.self_attention.linear_qkv`) and their adapters."""
    return {name.removesuffix(".lora"): m for name, m in model.named_modules() if isinstance(m, ParallelLoRA)}


class MergedParameters(Mapping):
    """This shard's parameters by Megatron name, each adapted base weight read as its merged shard
    (computed when read, so an export holds merged copies only of what it is packing)."""

    def __init__(self, model: torch.nn.Module):
        self._params = dict(model.named_parameters())
        self._adapters = {f"{name}.weight": adapter for name, adapter in adapters(model).items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self._params[name].detach()
        return self._adapters[name].merged(weight) if name in self._adapters else weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


@contextmanager
def disabled(model: torch.nn.Module) -> Iterator[None]:
    """Within, every adapter of `model` is off: the model computes as its frozen base."""
    found = list(adapters(model).values())
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def trained_entries(spec: ModelSpec, lora: LoraConfig, stage: int, pp: int, critic: bool) -> list[Entry]:
    """The entries of stage `stage` whose parameters train (and are checkpointed) under LoRA: the
    adapters, and a critic's value head on the last stage."""
    head = [e for e in stage_entries(spec, stage, pp, critic) if e.hf_names == (VALUE_HEAD,)] if critic else []
    return lora_entries(spec, lora, stage, pp) + head


def checkpoint_header(lora: LoraConfig) -> dict:
    """What a LoRA checkpoint must agree on with the engine loading it."""
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets())}
