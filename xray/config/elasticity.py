"""An `elasticity` block (DeepSpeed's fields) and the batch it gives a world size.

Sits in the config layer. A role's `elasticity` block is typed here (DeepSpeed's keys, so a
DeepSpeed config keeps its meaning); when the data-parallel size of a model changes (a lost
Workhorse replaced by none, or new devices joining between `min_gpus` and `max_gpus`), the plan
(`xray/config/batches.py`) and the runtime take the batch for the new size from DeepSpeed's own
rule (`xray/config/elastic_rule.py`): one global batch for the block, and the world sizes it
allows; a size the rule refuses (v0.1) is an error that lists the valid ones. DeepSpeed's own
config keys for a batch are written by `xray/backends/elastic.py`. Pure Python: no torch, no
DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from xray.config.elastic_rule import ElasticRuleError, elastic_choice, micro_for

LR_SCALINGS = ("none", "linear", "sqrt")


class ElasticityError(ElasticRuleError):
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
    """Between candidate batches allowing as many world sizes, take the larger (True) or the smaller
    (DeepSpeed's rule, `xray/config/elastic_rule.py`)."""
    min_time: float = 0
    """Minutes an elastic group keeps a size before it grows again (DeepSpeed's hint to the
    scheduler; 0: grow as soon as devices appear). A lost device shrinks the group at once."""
    version: float = 0.2
    """DeepSpeed's rule: 0.1 (world sizes outside the block's valid list are refused) or 0.2 (per node
    of `num_gpus_per_node`; a world size outside the list gets a batch of its own); DeepSpeed's
    default is 0.2."""
    model_parallel_size: int = 1
    """Devices per model replica in DeepSpeed's v0.2 rule (v0.1 takes only 1)."""
    num_gpus_per_node: int = 1
    """Devices per node in DeepSpeed's v0.2 rule: it sizes jobs by whole nodes."""
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
        for name in ("max_train_batch_size", "min_gpus", "max_gpus", "model_parallel_size", "num_gpus_per_node"):
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
        unknown = sorted(set(block) - known)
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
    """The batch DeepSpeed's rule gives `world_size` data-parallel replicas (`elastic_choice`): its
    one global batch, split by the largest micro-batch size that divides each replica's share.
    ElasticityError, listing the valid sizes, at a size the rule refuses."""
    try:
        choice = elastic_choice(cfg, world_size)
    except ElasticRuleError as exc:
        raise ElasticityError(str(exc)) from None
    if world_size not in choice.valid_sizes:
        raise ElasticityError(
            f"world size {world_size} is not one DeepSpeed's elasticity allows for this block (a global batch "
            f"of {choice.train_batch_size}; valid sizes {list(choice.valid_sizes)}); run with one of those "
            "sizes, or change max_train_batch_size, micro_batch_sizes or the min_gpus/max_gpus bounds")
    micro = micro_for(cfg.micro_batch_sizes, choice.train_batch_size, world_size)
    if micro is None or choice.train_batch_size < micro * world_size:
        smallest = min(cfg.micro_batch_sizes)
        if smallest * world_size <= cfg.max_train_batch_size:
            raise ElasticityError(
                f"DeepSpeed's rule gives world size {world_size} a global batch of {choice.train_batch_size}, "
                f"not whole micro-batches of {list(cfg.micro_batch_sizes)} per replica (without "
                "prefer_larger_batch it takes the smallest fit, 0 when a micro-batch size fits no replica); "
                "set prefer_larger_batch: true or drop the micro-batch sizes that do not fit")
        raise ElasticityError(
            f"no valid batch for world size {world_size}: the smallest micro-batch {smallest} x {world_size} "
            f"replicas = {smallest * world_size} exceeds max_train_batch_size={cfg.max_train_batch_size}; "
            f"raise max_train_batch_size to at least {smallest * world_size}, add a smaller micro-batch size, "
            f"or use at most {cfg.max_train_batch_size // smallest} replicas")
    return ElasticBatch(world_size, micro, choice.train_batch_size // (micro * world_size))


def valid_world_sizes(cfg: ElasticityConfig, world_size: int) -> tuple[int, ...]:
    """The data-parallel sizes DeepSpeed's rule allows for `cfg` (asked at `world_size`: v0.2 adds
    that size's own batch when it is not in the block's list)."""
    try:
        return elastic_choice(cfg, world_size).valid_sizes
    except ElasticRuleError as exc:
        raise ElasticityError(str(exc)) from None


def scaled_lr(cfg: ElasticityConfig, lr: float, batch: int, reference_batch: int) -> float:
    """The learning rate for a global batch of `batch` sequences when `lr` is that of `reference_batch`."""
    ratio = batch / reference_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": ratio ** 0.5}[cfg.lr_scaling]


def device_batch(cfg: ElasticityConfig, devices: int, model_parallel: int = 1) -> ElasticBatch:
    """The batch for `devices` devices of a model split `model_parallel` ways (tp x pp): the
    devices must be a multiple of `model_parallel`; the batch is DeepSpeed's for `devices /
    model_parallel` data-parallel replicas (`elastic_batch`)."""
    if devices % model_parallel:
        raise ElasticityError(f"{devices} devices do not hold whole replicas of a model split {model_parallel} "
                              f"ways (tp x pp); use a multiple of {model_parallel}")
    return elastic_batch(cfg, devices // model_parallel)
