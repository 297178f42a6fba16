"""Expert parallelism on Megatron: the ranks of one expert-parallel group run their micro-batches together.

Used by `MegatronEngine` when `ParallelDims.ep > 1`. Megatron's allgather token dispatcher gathers
each MoE layer's tokens over the expert-parallel group in tensors of one shape, so the group's
ranks must run the same number of micro-batches, the i-th of one [rows, width] on every rank.
Each rank cuts its own slice as usual (by rows, or by a token budget whose count the group agrees
on: `agree_count`), then `even` pads the i-th micro-batch of every rank to the group's largest:
rows with no attention and no loss token, columns of right padding (masked like any padding, so
no output at a real position and no loss term changes). A forward whose ranks hold different
numbers of micro-batches is topped up with empty ones; a train step's count must agree before
its loss denominators are cut (they divide by the number of micro-batches), so there a
difference is an error that names the fix. `uneven` cuts the outputs back to each micro-batch's
own rows and width. Also here: Megatron's load-balancing loss as a metric (`router_loss`) and
routing replay (`replaying`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from xray.data import columns as C
from xray.data.batch import Batch


class ExpertBatchError(ValueError):
    """Ranks of one expert-parallel group that cannot run their micro-batches together."""


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group()


def agree_count(count: int, device: torch.device) -> int:
    """The largest micro-batch count over this rank's expert-parallel group."""
    t = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group())
    return int(t)


def shape_of(mb: Batch) -> tuple[int, int]:
    """(rows, width) of a micro-batch."""
    return len(mb), mb[C.ATTENTION_MASK].shape[1]


def _padded(mb: Batch, rows: int, width: int) -> Batch:
    """`mb` with zero rows appended up to `rows` and its [B, T] / [B, T-1] columns right-padded up to
    `width` / `width - 1` (other columns padded in rows only)."""
    have_rows, have_width = shape_of(mb)
    tensors = {}
    for key, v in mb.tensors.items():
        if v.dim() >= 2 and v.shape[1] in (have_width, have_width - 1):
            grow = width - have_width
            v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, grow))
        if rows > have_rows:
            v = torch.cat([v, v.new_zeros((rows - have_rows, *v.shape[1:]))])
        tensors[key] = v
    return Batch(tensors, dict(mb.lists), dict(mb.meta))


def even(micro: list[Batch], device: torch.device, fill: bool, one_shape: bool) -> list[Batch]:
    """This rank's micro-batches padded to the group's shapes (see the module docstring). `fill`:
    top a shorter list up with empty micro-batches (forwards only); `one_shape`: every micro-batch
    to the largest shape of all (a pipeline schedule sends one activation shape)."""
    bounds = torch.tensor([len(micro), -len(micro)], dtype=torch.long, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=_group())
    count, fewest = int(bounds[0]), -int(bounds[1])
    if count != fewest and not fill:
        raise ExpertBatchError(
            f"the ranks of an expert-parallel group cut their train slices into {fewest} to {count} "
            "micro-batches, and each must run as many: give every data-parallel slice the same number "
            "of rows, or cut by max_tokens_per_micro_batch (its count is agreed across the group)")
    shapes = torch.zeros(count, 2, dtype=torch.long, device=device)
    for i, mb in enumerate(micro):
        shapes[i] = torch.tensor(shape_of(mb))
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=_group())
    if one_shape:
        shapes[:] = shapes.max(0).values
    empty = micro[0].index(torch.arange(0))
    return [_padded(micro[i] if i < len(micro) else empty, int(r), int(w)) for i, (r, w) in enumerate(shapes.tolist())]


def uneven(stored: list[dict[str, torch.Tensor]], shapes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
    """A forward's outputs ([rows, width - 1] per micro-batch, padded) cut back to the `shapes`
    of this rank's own micro-batches (the empty ones that topped it up dropped)."""
    return [{k: v[:rows, :width - 1] for k, v in out.items()} for out, (rows, width) in zip(stored, shapes)]


def router_loss(micro_batches: int, dp: int, device: torch.device) -> float | None:
    """Megatron's load-balancing loss of the train step just run, unweighted: summed over the MoE
    layers (every pipeline stage's), averaged over the micro-batches and the data-parallel replicas;
    None when the router computed none. Megatron's routers add it to a tracker of their own, which
    this reads and clears."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    names = sorted(n for n in tracker if n.endswith("load_balancing_loss"))
    if not names:
        return None
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for name in names:
        total += tracker[name]["values"].sum().to(device, torch.float64)
        tracker[name]["values"].zero_()
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total) / (micro_batches * dp)


@contextlib.contextmanager
def replaying(model: torch.nn.Module, mb: Batch) -> Iterator[None]:
    """Inside, the model's routers take the experts the micro-batch's ROUTED_EXPERTS `[b, s, L, K]`
    name for each token (routing replay: Megatron's `RouterReplay`, each router's own, so that two
    engines of one process never mix) instead of choosing; padding positions go to experts 0..K-1.
    Without the column, a plain forward."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routing = mb.tensors.get(C.ROUTED_EXPERTS)
    if routing is None:
        yield
        return
    k = routing.shape[-1]
    filler = torch.arange(k, dtype=routing.dtype, device=routing.device)
    routing = torch.where((mb[C.ATTENTION_MASK] != 0)[..., None, None], routing, filler)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        if router.router_replay is None:
            raise ExpertBatchError("the batch carries ROUTED_EXPERTS but the engine was built without routing "
                                   "replay; build it with moe=MoeConfig(routing_replay=True)")
        chosen = routing[:, :, router.layer_number - 1].transpose(0, 1).reshape(-1, k)  # Megatron's [s * b] order
        router.router_replay.set_target_indices(chosen.long())
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
