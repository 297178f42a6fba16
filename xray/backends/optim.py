"""Optimizer and learning-rate schedule shared by the training backends and the parity reference.

Both training backends and `xray.check.reference` build the same torch AdamW and the same
learning-rate schedule (`lr_schedule.py`: warm-up, then constant, cosine or linear decay), so
that a sharded step and the single-process reference step agree to rounding.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from xray.backends.base import OptimConfig
from xray.backends.lr_schedule import decay_horizon, lr_factor


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW (no fused or foreach kernels, so every layout runs the same arithmetic)."""
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False, fused=False)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The torch scheduler of `cfg`'s schedule (`xray.backends.lr_schedule.lr_factor`), stepped once
    per optimizer step; a decaying schedule without its horizon fails here, at build."""
    if cfg.lr_schedule != "constant":
        decay_horizon(cfg)
    # a plain function, not a callable object: the scheduler's state dict then holds no lambda state
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def follow_configured_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """After a checkpoint's scheduler and optimizer state loaded: the peak lr becomes `lr`, the
    engine's own (an elastic run's lr for its new batch, `elasticity.lr_scaling`), at the
    schedule's restored position; a checkpoint taken with the same lr is left as it was."""
    if all(base == lr for base in scheduler.base_lrs):
        return
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    now = [lr * f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
    for group, value in zip(scheduler.optimizer.param_groups, now):
        group["lr"] = value
    scheduler._last_lr = now


SKIPPED = "skipped"
"""A loss function's metric: 1 for a micro-batch that gave no gradient on purpose (a guard)."""


ABORT = "abort_update"
"""A loss function's metric: above 0 on any micro-batch of any replica, the whole update is left
out (a check that failed before the update, such as the end-to-end check of a weight sync)."""


def skips_update(mean_skipped: float | None, mean_abort: float | None = None) -> bool:
    """True when every micro-batch of an update, on every replica, was skipped (the mean of the
    loss function's `skipped` metric is 1), or any asked to abort it (`ABORT`): the engine then
    leaves the weights as they are."""
    return (mean_skipped is not None and mean_skipped >= 1.0 - 1e-9) or bool(mean_abort)


@contextmanager
def frozen_lr(optimizer: torch.optim.Optimizer, frozen: bool) -> Iterator[None]:
    """Within, a `frozen` optimizer steps with lr 0: the weights stay (AdamW's decoupled weight
    decay is scaled by lr too) while its step count and moments move as for a zero gradient, so
    the lr schedule and the optimizer state advance the same on every backend."""
    if not frozen:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            if group["lr"] == 0.0:  # a scheduler stepped inside has set the next lr already
                group["lr"] = lr


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def state_bytes(parameters: Iterable[torch.nn.Parameter], optimizer) -> dict[str, int]:
    """Bytes this shard holds for training: its trainable parameters (`ds_numel` for a ZeRO-3
    partitioned one: the whole parameter, of which the optimizer holds this shard's part) and its
    optimizer's state (`optimizer_bytes`)."""
    trainable = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in parameters if p.requires_grad)
    return {"trainable": trainable, "optimizer": optimizer_bytes(optimizer)}


def optimizer_bytes(optimizer, seen: set | None = None) -> int:
    """Tensor bytes of an optimizer's state (Adam's moments and step), through the wrappers that
    hold one inside (`.optimizer`: DeepSpeed's ZeRO, Megatron's mixed-precision optimizer;
    `.chained_optimizers`: Megatron's chain), with the fp32 main copies a mixed-precision wrapper
    keeps."""
    seen = set() if seen is None else seen
    if optimizer is None or id(optimizer) in seen:
        return 0
    seen.add(id(optimizer))
    held = _tensor_bytes(getattr(optimizer, "state", {}))
    for name in ("fp32_from_float16_groups", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        held += _tensor_bytes(getattr(optimizer, name, []))
    held += optimizer_bytes(getattr(optimizer, "optimizer", None), seen)
    for inner in getattr(optimizer, "chained_optimizers", []):
        held += optimizer_bytes(inner, seen)
    return held
