"""DeepSpeed's elasticity rule: one global batch for an `elasticity` block and the world sizes it allows.

Sits in the config layer, under `xray/config/elasticity.py` (the block's fields and the batch a
world size gets). DeepSpeed 0.19.8 removed its `elasticity` package, so its rule is written out
here; `tests/unit/test_deepspeed_elastic_rule.py` holds it equal to `compute_elastic_config` of
the last DeepSpeed that shipped it, block by block and world size by world size.

The rule (DeepSpeed's elasticity v0.1): the global batch is fixed once for the block, so that a
job keeps its convergence whatever its size. Candidates are each micro-batch size, and their least
common multiple, scaled by the largest highly composite number that keeps the batch at most
`max_train_batch_size` (a base already that large stays as it is). A world size is valid for a
candidate when it divides `candidate / micro` for some micro-batch size that divides the candidate,
within [min_gpus, max_gpus]. The candidate valid at the most world sizes wins; a tie goes to the
larger batch (`prefer_larger_batch`, the default) or the smaller.

v0.2 works per node: `num_gpus_per_node` devices make a node of `num_gpus_per_node /
model_parallel_size` data-parallel replicas; the v0.1 rule picks the batch per node-replica, for
whole nodes. A world size outside its valid list is not refused there: it gets the largest (or,
without `prefer_larger_batch`, smallest) multiple of micro-batch x world size within
`max_train_batch_size`, valid for that size alone. World sizes here are data-parallel replicas,
the `world_size` DeepSpeed's runtime passes. Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Block(Protocol):
    """The fields of an `elasticity` block the rule reads (`xray.config.elasticity.ElasticityConfig`)."""

    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int
    max_gpus: int
    prefer_larger_batch: bool
    version: float
    model_parallel_size: int
    num_gpus_per_node: int

HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
                    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
                    221760, 277200, 332640, 498960, 554400, 665280, 720720)
"""The 38 smallest highly composite numbers (OEIS A002182), DeepSpeed's scale factors: batches up to
about 720k sequences."""


class ElasticRuleError(ValueError):
    """A block the rule gives no batch for; the message says the fix."""


@dataclass(frozen=True)
class ElasticChoice:
    """What the rule gives a block at one world size."""

    train_batch_size: int
    """The global batch: sequences per optimizer step over all replicas."""
    valid_sizes: tuple[int, ...]
    """The data-parallel world sizes that batch allows, ascending."""


def _scaled(base: int, limit: int) -> int:
    """`base` times the largest highly composite number keeping it at most `limit` (`base` when it
    is already `limit` or more)."""
    if base >= limit:
        return base
    room = limit // base
    return base * max(h for h in HIGHLY_COMPOSITE if h <= room)


def divisors_within(n: int, low: int, high: int) -> list[int]:
    """The divisors of `n` in [low, high]."""
    return [d for d in range(max(low, 1), min(high, n) + 1) if n % d == 0]


def valid_sizes(batch: int, micro: tuple[int, ...], low: int, high: int) -> tuple[int, ...]:
    """The world sizes in [low, high] at which `batch` splits into whole micro-batches: divisors of
    `batch / m` for each micro-batch size `m` dividing `batch`."""
    sizes: set[int] = set()
    for m in micro:
        if batch % m == 0:
            sizes.update(divisors_within(batch // m, low, high))
    return tuple(sorted(sizes))


def rule_v01(micro: tuple[int, ...], max_batch: int, low: int, high: int, prefer_larger: bool) -> ElasticChoice:
    """The v0.1 rule (module docstring). `low`/`high` of 0 mean 1 and `max_batch // min(micro)`."""
    low = low or 1
    high = high or max_batch // min(micro)
    if any(m > max_batch for m in micro):
        raise ElasticRuleError(f"elasticity.micro_batch_sizes {list(micro)} holds a size above "
                               f"max_train_batch_size={max_batch}; raise it or drop that micro-batch size")
    candidates = {_scaled(base, max_batch) for base in (*micro, math.lcm(*micro))}
    best: ElasticChoice | None = None
    for batch in sorted(candidates):
        choice = ElasticChoice(batch, valid_sizes(batch, micro, low, high))
        if not choice.valid_sizes:
            continue
        if best is None or len(choice.valid_sizes) > len(best.valid_sizes) or (
                len(choice.valid_sizes) == len(best.valid_sizes) and prefer_larger == (batch > best.train_batch_size)):
            best = choice
    return best or ElasticChoice(0, ())  # no candidate allows any size in the bounds


def rule_v02(cfg: Block, world_size: int) -> ElasticChoice:
    """The v0.2 rule at `world_size` data-parallel replicas (module docstring)."""
    per_node, mp = cfg.num_gpus_per_node, cfg.model_parallel_size
    if per_node % mp:
        raise ElasticRuleError(f"elasticity.num_gpus_per_node={per_node} is not a multiple of "
                               f"model_parallel_size={mp}; give whole model replicas per node")
    replicas_per_node = per_node // mp
    nodes = rule_v01(cfg.micro_batch_sizes, int(cfg.max_train_batch_size / replicas_per_node),
                     int(cfg.min_gpus / per_node), int(cfg.max_gpus / per_node), cfg.prefer_larger_batch)
    batch = nodes.train_batch_size * replicas_per_node
    sizes = tuple(v * replicas_per_node for v in nodes.valid_sizes)
    if world_size // mp in sizes:
        return ElasticChoice(batch, sizes)
    replicas = world_size / per_node * replicas_per_node
    fits = [math.floor(cfg.max_train_batch_size / (m * replicas)) * m * replicas for m in cfg.micro_batch_sizes]
    return ElasticChoice(int(max(fits) if cfg.prefer_larger_batch else min(fits)), (int(replicas),))


def elastic_choice(cfg: Block, world_size: int) -> ElasticChoice:
    """DeepSpeed's batch and valid world sizes for `cfg` when the job has `world_size` replicas."""
    if float(cfg.version) == 0.1:
        if cfg.model_parallel_size > 1:
            raise ElasticRuleError(f"elasticity version 0.1 does not take model_parallel_size="
                                   f"{cfg.model_parallel_size}; use version 0.2")
        choice = rule_v01(cfg.micro_batch_sizes, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus,
                          cfg.prefer_larger_batch)
        if not choice.valid_sizes:
            raise ElasticRuleError(f"no world size in [min_gpus={cfg.min_gpus}, max_gpus={cfg.max_gpus}] divides "
                                   f"a batch of micro-batches {list(cfg.micro_batch_sizes)} within "
                                   f"max_train_batch_size={cfg.max_train_batch_size}; widen the bounds or raise "
                                   "max_train_batch_size")
        return choice
    return rule_v02(cfg, world_size)


def micro_for(micro: tuple[int, ...], batch: int, world_size: int) -> int | None:
    """The largest micro-batch size dividing each replica's share of `batch` (None: none does)."""
    share = batch // world_size
    fitting = [m for m in set(micro) if share % m == 0]
    return max(fitting) if fitting else None
