"""Elastic batch arithmetic: the train batch as micro-batch x accumulation x world size.

Sits in the config layer. A role's `elasticity` block (DeepSpeed's fields, so a DeepSpeed-style
config keeps its meaning) is typed here; when the data-parallel size of a model changes (a lost
Workhorse replaced by none, or new devices joining between `min_gpus` and `max_gpus`), the plan
(`xray/config/batches.py`) and the runtime recompute the batch here for the new world size.
DeepSpeed's own config keys for a batch are written by `xray/backends/elastic.py`. Pure Python:
no torch, no DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

LR_SCALINGS = ("none", "linear", "sqrt")


class ElasticityError(ValueError):
    """An elasticity block or world size that gives no valid batch; the message says the fix."""


@dataclass(frozen=True)
class ElasticityConfig:
    """DeepSpeed's `elasticity` block: the bounds within which the batch is recomputed."""

    max_train_batch_size: int
    """Upper bound of the global train batch (sequences per optimizer step, all replicas)."""
    micro_batch_sizes: tuple[int, ...]
    """Micro-batch sizes (per replica, per forward/backward) the model fits in memory."""
    min_gpus: int = 1
    """Smallest world size training may continue with."""
    max_gpus: int = 10000
    """Largest world size training may grow to."""
    ignore_non_elastic_batch_info: bool = False
    """If False, a config that also sets the plain batch keys is an error (they would be
    overridden silently); if True, the elastic values replace them."""
    enabled: bool = True
    """False leaves a config's plain batch keys untouched (in a run config: the role is not
    elastic, as if the block were absent)."""
    prefer_larger_batch: bool = True
    """Among the batches a world size allows, take the one closest to `max_train_batch_size`
    (True), or the smallest (False: fewer sequences per optimizer step)."""
    min_time: float = 0
    """Minutes an elastic group keeps a size before it grows again (DeepSpeed's hint to the
    scheduler; 0: grow as soon as devices appear). A lost device shrinks the group at once."""
    version: float = 0.1
    """The block's format (DeepSpeed's 0.1 or 0.2: the keys read here are the same)."""
    lr_scaling: str = "none"
    """How the learning rate follows the global batch when the world size changes (xray's key, not
    DeepSpeed's): `none` keeps `optim.lr`; `linear` multiplies it by batch / reference batch,
    `sqrt` by the square root of that; the reference batch is the one at the group's full size,
    for which `optim.lr` is written."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "micro_batch_sizes", tuple(self.micro_batch_sizes))
        if not self.micro_batch_sizes:
            raise ElasticityError("elasticity.micro_batch_sizes is empty; list at least one size, e.g. [1, 2, 4]")
        for m in self.micro_batch_sizes:
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ElasticityError(f"elasticity.micro_batch_sizes holds {m!r}; use positive integers")
        for name in ("max_train_batch_size", "min_gpus", "max_gpus"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ElasticityError(f"elasticity.{name} must be a positive integer, got {value!r}")
        if self.version not in (0.1, 0.2):
            raise ElasticityError(f"elasticity.version={self.version!r}; the block's formats are 0.1 and 0.2")
        if not isinstance(self.min_time, (int, float)) or isinstance(self.min_time, bool) or self.min_time < 0:
            raise ElasticityError(f"elasticity.min_time={self.min_time!r}; give minutes >= 0")
        if self.lr_scaling not in LR_SCALINGS:
            raise ElasticityError(f"elasticity.lr_scaling={self.lr_scaling!r}; choose one of {', '.join(LR_SCALINGS)}")
        if self.min_gpus > self.max_gpus:
            raise ElasticityError(f"elasticity.min_gpus={self.min_gpus} exceeds max_gpus={self.max_gpus}; "
                                  "set min_gpus <= max_gpus")

    @classmethod
    def from_dict(cls, block: Mapping[str, Any]) -> "ElasticityConfig":
        """Build from a config block; an unknown key is an error that names it."""
        known = {f.name for f in fields(cls)}
        # DeepSpeed's block also carried these; they have no meaning for the arithmetic here.
        passive = {"model_parallel_size", "num_gpus_per_node"}
        unknown = sorted(set(block) - known - passive)
        if unknown:
            raise ElasticityError(f"unknown elasticity keys {unknown}; valid keys are {sorted(known)}")
        return cls(**{k: v for k, v in block.items() if k in known})


@dataclass(frozen=True)
class ElasticBatch:
    """The batch for one world size: train_batch_size = micro_batch_size x accumulation x world_size."""

    world_size: int
    """Data-parallel replicas the batch is spread over."""
    micro_batch_size: int
    """Sequences per replica per forward/backward."""
    gradient_accumulation_steps: int
    """Micro-batches per replica per optimizer step."""

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size


def elastic_batch(cfg: ElasticityConfig, world_size: int) -> ElasticBatch:
    """The largest train batch <= cfg.max_train_batch_size that is micro x accumulation x world_size.

    Among micro-batch sizes reaching that largest batch, the largest micro-batch wins (fewer
    accumulation steps, same arithmetic). With `prefer_larger_batch` false, the smallest of the
    micro-batch sizes' largest batches instead. Raises ElasticityError when the world size is
    outside [min_gpus, max_gpus] or when no micro-batch size fits even once per replica.
    """
    if not cfg.min_gpus <= world_size <= cfg.max_gpus:
        raise ElasticityError(
            f"world size {world_size} is outside elasticity's [min_gpus={cfg.min_gpus}, "
            f"max_gpus={cfg.max_gpus}]; run with a world size in that range or widen the range")
    best: ElasticBatch | None = None
    for micro in sorted(set(cfg.micro_batch_sizes)):
        accumulation = cfg.max_train_batch_size // (micro * world_size)
        if accumulation < 1:
            continue
        candidate = ElasticBatch(world_size, micro, accumulation)
        if cfg.prefer_larger_batch:
            better = best is None or candidate.train_batch_size >= best.train_batch_size
        else:
            better = best is None or candidate.train_batch_size < best.train_batch_size
        if better:
            best = candidate
    if best is None:
        smallest = min(cfg.micro_batch_sizes)
        raise ElasticityError(
            f"no valid batch for world size {world_size}: the smallest micro-batch {smallest} x "
            f"{world_size} replicas = {smallest * world_size} exceeds max_train_batch_size="
            f"{cfg.max_train_batch_size}; raise max_train_batch_size to at least "
            f"{smallest * world_size}, add a smaller micro-batch size, or use at most "
            f"{cfg.max_train_batch_size // smallest} replicas")
    return best


def scaled_lr(cfg: ElasticityConfig, lr: float, batch: int, reference_batch: int) -> float:
    """The learning rate for a global batch of `batch` sequences when `lr` is that of `reference_batch`."""
    ratio = batch / reference_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": ratio ** 0.5}[cfg.lr_scaling]


def device_batch(cfg: ElasticityConfig, devices: int, model_parallel: int = 1) -> ElasticBatch:
    """The batch for `devices` devices of a model split `model_parallel` ways (tp x pp): the
    devices must lie in [min_gpus, max_gpus] and be a multiple of `model_parallel`; the batch is
    that of `devices / model_parallel` data-parallel replicas."""
    if not cfg.min_gpus <= devices <= cfg.max_gpus:
        raise ElasticityError(
            f"{devices} devices are outside elasticity's [min_gpus={cfg.min_gpus}, max_gpus={cfg.max_gpus}]; "
            "run with a device count in that range or widen the range")
    if devices % model_parallel:
        raise ElasticityError(f"{devices} devices do not hold whole replicas of a model split {model_parallel} "
                              f"ways (tp x pp); use a multiple of {model_parallel}")
    dp = devices // model_parallel
    return elastic_batch(replace(cfg, min_gpus=1, max_gpus=max(dp, 1)), dp)
