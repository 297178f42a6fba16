"""Gradients after Megatron's pipeline schedule: data-parallel mean, tied embeddings, clipping.

Used by `MegatronEngine.train_step` between the backward passes and the optimizer step (the job
Megatron's DistributedDataParallel + finalize_model_grads do, on plain `.grad`s so that the torch
AdamW of `xray/backends/optim.py` steps them exactly like the single-process reference):
0. `allreduce_tensor_partial`: the replicated weights applied to each tp rank's own heads (Qwen3's
   q/k norms) sum their partial gradients over the tensor-parallel group;
1. `allreduce_data_parallel`: mean of every gradient over the data-parallel group, in flat buckets;
   a routed expert's (`is_expert`) is summed over its expert-data-parallel group instead and
   divided by the whole data-parallel size: its gradient already sums the tokens its
   expert-parallel peers sent it;
2. `allreduce_tied_embedding`: with pipeline parallelism and tied embeddings, the input embedding
   (first stage) and its copy in the output layer (last stage) sum their gradients;
3. `clip_grad_norm`: the global norm over all tensor- and pipeline-parallel shards (and the
   experts of every expert-parallel rank), each element counted once, and torch's clipping rule
   (`clip_grad_norm_`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_ELEMENTS = 32 << 20


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def allreduce_tensor_partial(params: list[torch.nn.Parameter]) -> None:
    """Sum `params`' gradients over the tensor-parallel group (each rank holds the part its own
    heads contributed), in one flat bucket."""
    from megatron.core import parallel_state as ps

    grads = _grads(params)
    if ps.get_tensor_model_parallel_world_size() == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    for g_old, g_new in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g_old.copy_(g_new)


def is_expert(name: str) -> bool:
    """Whether the parameter `name` belongs to a routed expert (held by one expert-parallel rank)."""
    return ".local_experts." in name


def allreduce_data_parallel(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Replace every gradient by its mean over the data-parallel group (a routed expert's: the
    sum over its expert-data-parallel group / the data-parallel size)."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size()
    if size == 1:
        return
    dense = _grads([p for n, p in named if not is_expert(n)])
    experts = _grads([p for n, p in named if is_expert(n)])
    _bucketed_mean(dense, ps.get_data_parallel_group(), size)
    _bucketed_mean(experts, ps.get_expert_data_parallel_group(), size)


def _bucketed_mean(grads: list[torch.Tensor], group, size: int) -> None:
    """Sum `grads` over `group` in flat buckets and divide by `size`."""
    bucket: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        bucket.append(g)
        if i == len(grads) - 1 or sum(t.numel() for t in bucket) + grads[i + 1].numel() > BUCKET_ELEMENTS:
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            flat /= size
            for g_old, g_new in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g_old.copy_(g_new)
            bucket = []


def tied_embedding_weight(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The tied input embedding (first stage) or its copy (last stage) when pp > 1, else None."""
    from megatron.core import parallel_state as ps

    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return model.shared_embedding_or_output_weight()


def allreduce_tied_embedding(model: torch.nn.Module) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last pipeline stage)."""
    from megatron.core import parallel_state as ps

    weight = tied_embedding_weight(model)
    if weight is None or not weight.requires_grad or not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return  # (a frozen embedding: LoRA)
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def _counted_once(model: torch.nn.Module, replicated: set[str]) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters whose elements this rank counts in the global norm: tensor-parallel shards,
    the `replicated` ones (same on every tp rank) on tp_rank 0 only, and the tied embedding on
    the first stage only."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    copy = tied_embedding_weight(model) if not ps.is_pipeline_first_stage() else None
    return [(name, p) for name, p in model.named_parameters()
            if p.grad is not None and p is not copy and (tp_rank == 0 or name not in replicated)]


def _squares(grads: list[torch.Tensor], device: torch.device, group) -> torch.Tensor:
    """The squared norm of `grads` summed over `group` (torch's own foreach norm of this rank's part)."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        squares = torch.nn.utils.get_total_norm(grads).float() ** 2
    dist.all_reduce(squares, group=group)
    return squares


def clip_grad_norm(model: torch.nn.Module, max_norm: float, replicated: set[str]) -> float:
    """Global gradient norm across tensor and pipeline shards and expert-parallel ranks; scale
    grads down to `max_norm` (0 disables the scaling). `replicated` names the parameters that every
    tensor-parallel rank holds whole. Returns the norm before clipping."""
    from megatron.core import parallel_state as ps

    counted = _counted_once(model, replicated)
    device = next(model.parameters()).device
    squares = _squares([p.grad.detach() for n, p in counted if not is_expert(n)], device,
                       ps.get_model_parallel_group())
    experts = [p.grad.detach() for n, p in counted if is_expert(n)]
    if experts or any(is_expert(n) for n, _ in model.named_parameters()):
        squares = squares + _squares(experts, device, ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = squares.sqrt()
    if max_norm > 0:
        with_grads = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return float(norm)
