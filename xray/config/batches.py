"""The training batch sizes of a PPO run for a given layout, elastic groups included.

Sits between the config and the runtime. Without `elasticity`, the mini-batch (sequences per
optimizer step, all replicas) is `ppo.mini_batch_size` and each role's micro-batch its
`micro_batch_size`. A trained role with an `elasticity` block takes both from DeepSpeed's
rule (`xray/config/elasticity.py`) for its current device count: micro-batch x accumulation
x data-parallel size, the actor's product being the mini-batch. A device group holding such a
role is elastic: its size may move within [min_gpus, max_gpus] (and at most its ranks) while the
run goes on (`xray/run/recovery/elastic.py`), and the plan checks every size it may take.
"""
from __future__ import annotations

from dataclasses import dataclass

from xray.config.elasticity import ElasticityError, device_batch, scaled_lr
from xray.config.parallel import ParallelDims
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError

TRAINED = ("actor", "critic", "reference", "teacher")


@dataclass(frozen=True)
class TrainBatches:
    """Sequences per optimizer step, and per-role micro-batches, for one layout."""

    mini_batch_size: int
    micro: tuple[tuple[str, int], ...]
    """(role, rows per micro-batch per replica) for actor, critic and reference."""

    def micro_of(self, role: str) -> int:
        return dict(self.micro)[role]


@dataclass(frozen=True)
class ElasticRange:
    """The device counts an elastic group may take."""

    group: str
    roles: tuple[str, ...]
    """The trained roles placed in the group; they resize together."""
    sizes: tuple[int, ...]
    """Valid device counts, ascending (within every role's bounds, whole replicas for each)."""
    min_time: float = 0
    """Minutes the group keeps a size before it grows again (the roles' largest `min_time`)."""

    @property
    def smallest(self) -> int:
        return self.sizes[0]

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fit(self, devices: int) -> int | None:
        """The largest valid count not above `devices`; None if even the smallest does not fit."""
        fitting = [n for n in self.sizes if n <= devices]
        return fitting[-1] if fitting else None


def role_parallel(cfg: RunConfig, role: str, devices: int) -> ParallelDims:
    """A trained role's layout on `devices` devices: its tp and pp, the rest data parallel."""
    rc = getattr(cfg, role)
    return ParallelDims(rc.tp, rc.pp, devices // (rc.tp * rc.pp))


def train_batches(cfg: RunConfig, devices: dict[str, int]) -> TrainBatches:
    """The batches when each trained role (key) has that many devices; ElasticityError if an
    elastic role cannot take them."""
    mini, micro = cfg.ppo.mini_batch_size, []
    for role in TRAINED:
        rc = getattr(cfg, role)
        if rc.elasticity is None or role not in devices:
            micro.append((role, rc.micro_batch_size))
            continue
        batch = device_batch(rc.elasticity, devices[role], rc.tp * rc.pp)
        micro.append((role, batch.micro_batch_size))
        if role == "actor":
            mini = batch.train_batch_size
    for role in ("critic",):
        rc = getattr(cfg, role)
        if rc.elasticity is not None and role in devices and "actor" in devices:
            own = device_batch(rc.elasticity, devices[role], rc.tp * rc.pp).train_batch_size
            if own != mini:
                raise ElasticityError(f"on {devices[role]} devices the critic's elastic batch is {own} sequences "
                                      f"but the actor's mini-batch is {mini}; give actor and critic the same "
                                      "elasticity block (they train on the same mini-batches)")
    return TrainBatches(mini, tuple(micro))


def supervised_batches(cfg: RunConfig, devices: dict[str, int]) -> TrainBatches:
    """A supervised job's batches (`xray/run/supervised.py`) when the actor has `devices["actor"]`
    devices: `sft.batch_size` sequences per optimizer step and the actor's micro-batch, or with
    `actor.elasticity` DeepSpeed's rule for that many devices (its one global batch)."""
    if cfg.actor.elasticity is None or "actor" not in devices:
        return TrainBatches(cfg.sft.batch_size, (("actor", cfg.actor.micro_batch_size),))
    batch = device_batch(cfg.actor.elasticity, devices["actor"], cfg.actor.tp * cfg.actor.pp)
    return TrainBatches(batch.train_batch_size, (("actor", batch.micro_batch_size),))


def elastic_ranges(cfg: RunConfig, groups) -> list[ElasticRange]:
    """The elastic device groups of `groups` (`DeviceGroups`), with the sizes each may take."""
    out = []
    for g in groups.groups:
        elastic = [r for r in g.workers if r in TRAINED and getattr(cfg, r).elasticity is not None]
        if not elastic:
            continue
        others = [r for r in g.workers if r not in TRAINED]
        if others:
            raise ConfigError(f"device_groups.{g.name}: an elastic group (its {', '.join(elastic)} set elasticity) "
                              f"changes size, and {others} cannot follow; place them in another group")
        if cfg.trainer.mode != "sync":
            raise ConfigError(f"{elastic[0]}.elasticity: elastic resizing runs with trainer.mode=sync; remove the "
                              "elasticity blocks or use the synchronous mode")
        lo = max(getattr(cfg, r).elasticity.min_gpus for r in elastic)
        hi = min([g.size] + [getattr(cfg, r).elasticity.max_gpus for r in elastic])
        trained = [r for r in g.workers if r in TRAINED]
        sizes = tuple(n for n in range(lo, hi + 1)
                      if all(n % (getattr(cfg, r).tp * getattr(cfg, r).pp) == 0 for r in trained)
                      and all(_allowed(cfg, r, n) for r in elastic))
        if g.size not in sizes:
            raise ConfigError(f"{elastic[0]}.elasticity: device group {g.name!r} has {g.size} ranks, not a size its "
                              f"elasticity allows (min_gpus {lo}, max_gpus {hi}, whole tp x pp replicas, and "
                              f"DeepSpeed's rule for the block: the sizes it allows here are {list(sizes)}); change "
                              "the ranks or the block")
        out.append(ElasticRange(g.name, tuple(trained), sizes,
                                max(getattr(cfg, r).elasticity.min_time for r in elastic)))
    return out


def _allowed(cfg: RunConfig, role: str, devices: int) -> bool:
    """Whether DeepSpeed's elasticity rule gives `role` a batch on `devices` devices."""
    rc = getattr(cfg, role)
    try:
        device_batch(rc.elasticity, devices, rc.tp * rc.pp)
    except ElasticityError:
        return False
    return True


def role_lr(cfg: RunConfig, role: str, devices: int) -> float:
    """A trained role's peak learning rate on `devices` devices: `optim.lr`, or for an elastic role
    that rate scaled (`elasticity.lr_scaling`) from the batch at its group's full size to the batch
    at `devices`."""
    rc = getattr(cfg, role)
    if rc.elasticity is None or rc.elasticity.lr_scaling == "none":
        return rc.optim.lr
    full = next(er.largest for er in elastic_ranges(cfg, cfg.device_groups) if role in er.roles)
    mp = rc.tp * rc.pp
    return scaled_lr(rc.elasticity, rc.optim.lr, device_batch(rc.elasticity, devices, mp).train_batch_size,
                     device_batch(rc.elasticity, full, mp).train_batch_size)


def check_batch_info(cfg: RunConfig, groups, batch_key: str = "ppo.mini_batch_size") -> None:
    """`elasticity.ignore_non_elastic_batch_info` false (DeepSpeed's default): the run's own batch
    keys (`batch_key`, the job's sequences per optimizer step: `ppo.mini_batch_size` for an RL run,
    `sft.batch_size` for a supervised job; the role's `micro_batch_size`) must be the elastic batch
    at the group's full size, else a ConfigError with both; true: the elastic values replace them."""
    section, key = batch_key.split(".")
    steps_batch = getattr(getattr(cfg, section), key)
    for er in elastic_ranges(cfg, groups):
        for role in er.roles:
            rc = getattr(cfg, role)
            if rc.elasticity is None or rc.elasticity.ignore_non_elastic_batch_info:
                continue
            batch = device_batch(rc.elasticity, er.largest, rc.tp * rc.pp)
            given = {f"{role}.micro_batch_size": (rc.micro_batch_size, batch.micro_batch_size)}
            if role in ("actor", "critic"):
                given[batch_key] = (steps_batch, batch.train_batch_size)
            wrong = {k: v for k, v in given.items() if v[0] != v[1]}
            if wrong:
                raise ConfigError(
                    f"{role}.elasticity: at the group's full {er.largest} devices the elastic batch sets "
                    + ", ".join(f"{k}={want} (the config has {had})" for k, (had, want) in wrong.items())
                    + "; write those values, or set elasticity.ignore_non_elastic_batch_info: true to let the "
                    "elastic batch replace them")


def check_node_range(cfg: RunConfig, groups) -> None:
    """With `nnodes: MIN:MAX` the run must be able to start on MIN nodes: a group that is not
    elastic lies on their ranks, an elastic one reaches its smallest size on them."""
    if groups.min_nnodes is None:
        return
    least, elastic = groups.fewest_nodes, {er.group: er for er in elastic_ranges(cfg, groups)}
    for g in groups.groups:
        there = groups.on_fewest_nodes(g)
        er = elastic.get(g.name)
        if er is None and there < g.size:
            raise ConfigError(
                f"device_groups.{g.name}: {g.size - there} of its ranks lie beyond the first {least} node(s) "
                f"(nnodes {least}:{groups.nnodes}) and the group is not elastic, so the run could not start on "
                f"{least} node(s); move its ranks below {least * groups.nproc_per_node}, set elasticity on its "
                "trained roles, or raise MIN")
        if er is not None and there < er.smallest:
            raise ConfigError(
                f"device_groups.{g.name}: on the first {least} node(s) (nnodes {least}:{groups.nnodes}) the group "
                f"has {there} device(s), below the smallest size its elasticity allows ({er.smallest}; sizes "
                f"{list(er.sizes)}); lower min_gpus, move its ranks onto the first nodes, or raise MIN")
