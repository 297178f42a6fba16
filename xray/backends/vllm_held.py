"""What a vLLM engine holds after a reload, checked layer by layer against the tensors it was sent.

Called by the vLLM engine (`xray/backends/vllm.py`) after each in-place reload, inside the model
of this process (every tensor-parallel rank runs its own engine and checks its own shard). For
each layer the reload touched, the sent Hugging Face tensors are laid out as the layer holds them,
computed here independently of vLLM's loaders: fused parts concatenated in vLLM's order (q, k, v;
gate, up), then this rank's shard cut by the layer's kind (column-parallel: rows of each part,
k and v by kv-head group; row-parallel: columns; vocabulary-parallel: the rank's vocabulary
range, padding rows ignored). Then `xray/backends/held.py` checks the layer: bit for bit where
the engine keeps a readable tensor, else functionally, the layer's own `quant_method.apply` on a
seeded input (vLLM on CPU keeps only the oneDNN-packed copy of a linear weight). A layout this
module does not know counts as unchecked, and an unchecked tensor fails the sync. An MoE block
is checked as a whole, by its forward (`xray/backends/vllm_moe.py`). `held_units` names the
tensors a reload writes as the check names its verdicts: the engine reports them
(`VllmEngine.held_tensors`), and a tensor written without a verdict fails the sync.

vLLM's own account of what a reload wrote (its warning "Following weights were not loaded") is
kept by `ReloadLedger` over the reloads of a sync and reported at its end: a parameter that no
reload of the sync wrote fails it (`xray/sync/manifest.py`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from xray.backends.base import WeightBucket
from xray.backends.held import HeldCheck
from xray.backends.quantize import CHECKED_SCHEMES, FP8
from xray.backends.expert_names import moe_block_of
from xray.backends.vllm_moe import check_block

FUSED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""Hugging Face projections that vLLM fuses into one layer."""
FUSED_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
"""The order of the parts inside a fused tensor (rows)."""


def fused_layer_of(name: str) -> str:
    """The vLLM layer a Hugging Face tensor lands in: `...q_proj.weight` -> `...qkv_proj`; an MoE
    block's tensors (router, experts, shared expert) all land in the block (`...mlp`), reloaded
    and checked as one."""
    if (block := moe_block_of(name)) is not None:
        return block
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED_PARTS:
            return ".".join(parts[:i] + [FUSED_PARTS[part]])
    return name.rsplit(".", 1)[0]


def held_units(ready: WeightBucket, moe: bool) -> list[str]:
    """The engine tensors a reload of `ready` writes, each once, named as `check_model` gives its
    verdicts: a layer's tensor (`...qkv_proj.weight` for all of q, k, v), or in a model with
    experts (`moe`) each Hugging Face tensor of an MoE block (checked together by its forward)."""
    units = [name if moe and moe_block_of(name) is not None else _target_of(name) for name, _ in ready]
    return list(dict.fromkeys(units))


def _target_of(name: str) -> str:
    return f"{fused_layer_of(name)}.{name.rsplit('.', 1)[1]}"


def check_model(model: torch.nn.Module, ready: WeightBucket, dtype: torch.dtype, scheme: str | None,
                moe: tuple | None = None) -> dict:
    """Check every layer `ready` (whole Hugging Face tensors, fused layers and MoE blocks complete)
    reloaded in `model`; the counts (`HeldCheck.take`). `moe`: (the model's `Routing`, the engine's
    vLLM config) for a model with experts, whose blocks are checked by `vllm_moe.check_block`."""
    held = HeldCheck()
    modules = dict(model.named_modules())
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in ready:
        if moe is not None and (block := moe_block_of(name)) is not None:
            blocks.setdefault(block, {})[name] = tensor
            continue
        groups.setdefault(_target_of(name), []).append((name, tensor))
    for block, tensors in blocks.items():
        if block in modules:
            check_block(held, block, modules[block], tensors, *moe, dtype)
        else:
            held.skip(list(tensors))
    for target, parts in groups.items():
        layer, kind = target.rsplit(".", 1)
        module = modules.get(layer)
        parts.sort(key=lambda part: FUSED_ORDER.get(part[0].split(".")[-2], 0))
        pieces = local_shard(module, parts, kind)
        param = getattr(module, kind, None) if module is not None else None
        if pieces is None or not isinstance(param, torch.Tensor):
            held.skip([target])
            continue
        check_layer(held, target, module, param, kind, pieces, dtype, scheme)
    return held.take()


def check_layer(held: HeldCheck, target: str, module, param: torch.Tensor, kind: str, pieces: list[torch.Tensor],
                dtype: torch.dtype, scheme: str | None) -> None:
    """Check one held tensor (`pieces`: the sent values it should hold, in row order): exactly
    where it can be read, else functionally (a linear layer's weight), else count it unchecked."""
    readable = param.numel() > 0
    expected = pieces[0] if len(pieces) == 1 or not readable else torch.cat(pieces)
    if not readable:  # repacked and dropped (vLLM's CPU linear layers): to the functional check
        pass
    elif param.dtype == FP8:
        scale = getattr(module, "weight_scale", None)
        if scheme in CHECKED_SCHEMES and held.compare_fp8(target, param, scale, expected, dtype):
            return
    elif held.compare(target, param, expected):
        return
    method = getattr(module, "quant_method", None)
    width = getattr(module, "input_size_per_partition", None)
    if kind == "weight" and method is not None and hasattr(method, "apply") and width is not None \
            and not hasattr(module, "shard_indices"):
        held.compare_product(target, lambda x: method.apply(module, x.to(_device_of(module))), width, pieces,
                             dtype, param.dtype if readable else dtype)
    else:
        held.skip([target])


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def local_shard(module, parts: list[tuple[str, torch.Tensor]], kind: str) -> list[torch.Tensor] | None:
    """The sent tensors of one layer (its fused parts in order) laid out as this rank's `module`
    holds them, as row blocks (views: no copy); None for a layer kind we do not know at tp > 1."""
    tensors = [t for _, t in parts]
    tp, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if module is None or tp == 1 or getattr(module, "disable_tp", False):
        return tensors
    kind_of_layer = type(module).__name__
    if hasattr(module, "shard_indices"):  # VocabParallelEmbedding, ParallelLMHead
        s = module.shard_indices
        return [tensors[0][s.org_vocab_start_index:s.org_vocab_end_index]]
    if kind_of_layer == "RowParallelLinear":
        if kind != "weight":
            return tensors[:1]  # the bias is whole on every rank
        n = module.input_size_per_partition
        return [tensors[0][:, rank * n:(rank + 1) * n]]
    if kind_of_layer == "QKVParallelLinear":
        pieces = []
        for (name, t) in parts:
            part = name.split(".")[-2]
            if part == "q_proj":
                n, i = module.num_heads * module.head_size, rank
            else:
                n = module.num_kv_heads * (module.head_size if part == "k_proj" else module.v_head_size)
                i = rank // module.num_kv_head_replicas
            pieces.append(t[i * n:(i + 1) * n])
        return pieces
    if kind_of_layer in ("MergedColumnParallelLinear", "ColumnParallelLinear"):
        return [t[rank * (t.shape[0] // tp):(rank + 1) * (t.shape[0] // tp)] for t in tensors]
    if kind_of_layer == "ReplicatedLinear":
        return tensors
    return None


class ReloadLedger(logging.Filter):
    """vLLM's account of the parameters each in-place reload left unwritten, kept over the reloads
    of one sync: a parameter is written by the sync if any of its reloads wrote it. vLLM says it
    as a warning naming every parameter outside the bucket, at every bucket; the ledger takes that
    warning off the log and keeps it (a filter: changing a logger's level clears every logger's
    level cache, ~2 ms a reload). vLLM's layerwise reloader also warns about each layer a bucket
    leaves untouched: during a reload only its errors pass."""

    ACCOUNT = "vllm.model_executor.model_loader.reload.inplace"
    LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"

    def __init__(self) -> None:
        super().__init__()
        self.missed: set[str] | None = None
        self.last: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg.startswith("Following weights were not loaded") and record.args:
            self.last = set(record.args[0] if isinstance(record.args, tuple) else record.args)
            return False
        return True

    @contextlib.contextmanager
    def reloading(self) -> Iterator[None]:
        """Around one reload: its account taken off the log into the ledger."""
        account, noisy = logging.getLogger(self.ACCOUNT), logging.getLogger(self.LAYERWISE)
        self.last = set()
        account.addFilter(self)
        noisy.addFilter(_errors_only)
        try:
            yield
        finally:
            account.removeFilter(self)
            noisy.removeFilter(_errors_only)
        self.missed = set(self.last) if self.missed is None else self.missed & self.last

    def take(self) -> list[str]:
        """The parameters no reload since the last call wrote (reset afterwards)."""
        missed, self.missed = sorted(self.missed or ()), None
        return missed


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR
