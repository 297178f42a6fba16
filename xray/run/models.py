"""Build the WholeModels of a run from its config and placement plan.

Each role gets its section of the config and the bundles of its device group (roles of one group
share devices). Models start concurrently: each WholeModel's Workhorses build while the others
build, so a run's start-up costs about its slowest model, not the sum. `Models.replace` starts one
role anew on its devices (a Workhorse died); `Models.place` starts a device group's roles anew on
another number of devices (elastic data parallelism, `xray/run/recovery/elastic.py`), keeping the
devices that still stand. Both keep each model's WholeModel actor and restart only its Workhorses
(`WholeModel.restart`; those whose devices stay keep their processes), unless that actor was lost
with its node: then a new WholeModel starts.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from xray.config.batches import TRAINED, role_lr, role_parallel, train_batches
from xray.config.engines import engine
from xray.config.env import response_tokens
from xray.config.packing import node_packs
from xray.config.plan import Plan, RolePlan, rollout_sleeps
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError
from xray.wholemodel import WholeModel
from xray.wholemodel.placement import Bundles, release_all, reserve, reserve_plan
from xray.workhorse.roles import workhorse_class

log = logging.getLogger(__name__)


@dataclass
class Models:
    """The WholeModels of a run (a critic-free run has no critic; one without KL, or with a LoRA
    actor, no reference; a supervised job the actor alone)."""

    actor: WholeModel
    rollout: Optional[WholeModel] = None
    """None for a supervised job (`xray/run/supervised.py`): the actor alone."""
    critic: Optional[WholeModel] = None
    reference: Optional[WholeModel] = None
    reward: Optional[WholeModel] = None
    teacher: Optional[WholeModel] = None
    """On-policy distillation's teacher (`xray/config/distill.py`): forward only, like the reference."""
    bundles: dict[str, Bundles] = field(default_factory=dict)
    """Each role's devices; roles of one device group share one reservation, freed by `shutdown`."""
    plan: Optional[Plan] = None
    """The placement now: `place` changes the placed roles' layouts."""
    starter: Optional[Callable[..., WholeModel]] = None
    """Starts one role's WholeModel on the given layout and devices, `(role_plan, bundles, model)`:
    the Workhorses of `model` restarted there when its WholeModel actor lives, else a new one."""
    standby: int = 0
    """Standby processes per node for the models of trained device groups (`trainer.standby_workhorses`)."""
    threads: int = 1
    drained: set = field(default_factory=set)
    """Nodes this run told Ray to drain (a Workhorse there got SIGTERM): no standby waits there."""
    _standby_asked: dict = field(default_factory=dict)
    """role -> (its WholeModel, the nodes its standbys were asked for): asked again only on a change."""

    def replace(self, role: str) -> WholeModel:
        """Start `role`'s Workhorses anew on the same devices (one died: its replacement joins fresh
        process groups with the surviving shards, which rebuild in their own processes, or are
        replaced too when they hang in a collective or cannot rejoin: `WholeModel.restart`). The
        model holds the initial weights then: the caller restores its state."""
        if self.starter is None:
            raise RuntimeError("these models were not built by build_models; rebuild them yourself")
        new = self.starter(self.plan.role(role), self.bundles[role], getattr(self, role))
        setattr(self, role, new)
        kept = len(new.rejoined)
        log.warning("%s: replaced (%d new Workhorses, %d rebuilt in their own processes, on the same devices)", role,
                    len(new.layout) - kept, kept)
        return new

    def standing(self, group: str) -> int:
        """The devices of `group`'s reservation that still stand (`standing`: their nodes alive and
        not draining): what a resize keeps."""
        from xray.wholemodel.placement import standing

        bundles = self.bundles[next(r.role for r in self.plan.roles if r.group == group)]
        return sum(pg.bundle_count for pg in standing(bundles, tuple(self.drained)))

    def place(self, group: str, devices: int, cfg: RunConfig, timeout_s: float = 30.0) -> None:
        """Start device `group`'s roles on `devices` devices, data-parallel over them (tp and pp
        kept; elastic resizing, `xray/run/recovery/elastic.py`). The placement groups of its
        reservation that still stand serve again (`standing`), so the Workhorses in them keep their
        processes and rejoin at their new rank (`WholeModel.restart`); the lost ones are given back
        first, the rest of the new size is reserved, and standing ones it does not use are given
        back after. The models hold the initial weights: the caller restores their state.
        PlacementError if the cluster does not grant the rest in `timeout_s`."""
        import ray

        from xray.wholemodel.placement import standing

        old = self.bundles[next(r.role for r in self.plan.roles if r.group == group)]
        keep = standing(old, tuple(self.drained))
        for pg in old.placement_groups():
            if not any(pg is k for k in keep):  # on a lost or draining node: nothing of it serves again
                ray.util.remove_placement_group(pg)
        plan = resized(self.plan, group, devices, cfg)
        layouts = {r.role: r for r in plan.roles if r.group == group}
        first = next(iter(layouts.values()))
        new = reserve(group, devices, first.device, cfg.threads_per_worker, timeout_s, old.share, first.resources,
                      first.packs, keep=keep)
        self.plan = plan
        for role in layouts:
            self.bundles[role] = new
        with ThreadPoolExecutor(max_workers=len(layouts)) as pool:
            started = dict(zip(layouts, pool.map(lambda rp: self.starter(rp, new, getattr(self, rp.role)),
                                                 layouts.values())))
        for role, model in started.items():
            setattr(self, role, model)
        for pg in keep:
            if not any(pg is used for used in new.placement_groups()):  # the new size is smaller
                ray.util.remove_placement_group(pg)

    def keep_standby(self, group: str | None = None, check: bool = False) -> bool:
        """Keep `standby` warm processes of each trained device group's models (all groups, or
        `group`) on every alive node that can host the group (`WholeModel.keep_standby`; asked again
        when the nodes or a model changed); with `check`, whether they are all warm (else True)."""
        from xray.wholemodel.placement import hosting_nodes

        if not self.standby or self.plan is None:
            return True
        trained = {r.group for r in self.plan.roles if r.role in TRAINED}
        ready = True
        for g in sorted(trained if group is None else {group} & trained):
            roles = [r for r in self.plan.roles if r.group == g]
            nodes = tuple(n for n in hosting_nodes(roles[0].device, self.threads, roles[0].resources)
                          if n not in self.drained)
            for r in roles:
                model = getattr(self, r.role)
                if self._standby_asked.get(r.role) != (id(model), nodes):
                    model.keep_standby(self.standby, list(nodes))
                    self._standby_asked[r.role] = (id(model), nodes)
                ready = ready and (not check or model.standby_ready())
        return ready

    def warm_joined(self, group: str) -> bool:
        """Without standby processes (`trainer.standby_workhorses: 0`): whether every model of
        `group` holds a warm process on each node with devices free for it (a joined node), one
        started there now for the grow alone (no refill; `drop_joined` stops what the grow left),
        so that an elastic grow waits for no process start and the run goes on meanwhile."""
        from xray.wholemodel.placement import free_per_node

        roles = [r for r in self.plan.roles if r.group == group]
        nodes = tuple(sorted(free_per_node(roles[0].device, self.threads, roles[0].resources, tuple(self.drained))))
        ready = True
        for r in roles:
            model = getattr(self, r.role)
            if self._standby_asked.get(r.role) != (id(model), nodes):
                model.keep_standby(1, list(nodes), refill=False)
                self._standby_asked[r.role] = (id(model), nodes)
            ready = ready and model.standby_ready()
        return ready

    def drop_joined(self, group: str) -> None:
        """Stop the processes `warm_joined` started for `group` that its grow did not take."""
        for r in [r for r in self.plan.roles if r.group == group]:
            if self._standby_asked.pop(r.role, None) is not None:
                getattr(self, r.role).keep_standby(0, [])

    def all(self) -> list[WholeModel]:
        return [m for m in (self.actor, self.critic, self.reference, self.rollout, self.reward, self.teacher)
                if m is not None]

    def shutdown(self) -> None:
        models = list(self.all())
        with ThreadPoolExecutor(max_workers=max(1, len(models))) as pool:  # a busy model waits its own grace only
            list(pool.map(lambda m: m.shutdown(), models))
        release_all(list(self.bundles.values()))


def resized(plan: Plan, group: str, devices: int, cfg: RunConfig) -> Plan:
    """`plan` with device `group`'s roles on `devices` devices, data-parallel over them (tp, pp kept)."""
    roles = [r for r in plan.roles if r.group == group]
    dims = {r.role: role_parallel(cfg, r.role, devices) for r in roles}
    packs = node_packs(devices, list(dims.values()), plan.nproc_per_node)
    first = roles[0].ranks
    ranks = (first + tuple(range(max(first) + 1, max(first) + 1 + devices)))[:devices]
    layouts = {r.role: replace(r, ranks=ranks, nodes=(), parallel=dims[r.role], packs=packs) for r in roles}
    return replace(plan, roles=tuple(layouts.get(r.role, r) for r in plan.roles))


def reserve_elastic(cfg: RunConfig, plan: Plan) -> tuple[Plan, dict[str, Bundles]]:
    """Reserve every device group: a fixed one at its size (waiting for it), an elastic one at the
    largest size its bounds allow that the cluster grants now (`elasticity`: a run may start below
    its configured size and grow as devices join, `xray/run/recovery/elastic.py`); the plan resized."""
    from xray.config.batches import elastic_ranges
    from xray.wholemodel.placement import PlacementError, free_devices

    ranges = {er.group: er for er in elastic_ranges(cfg, cfg.device_groups)}
    fixed = replace(plan, roles=tuple(r for r in plan.roles if r.group not in ranges))
    bundles = reserve_plan(fixed, cfg.threads_per_worker)
    for group, er in ranges.items():
        roles = [r for r in plan.roles if r.group == group]
        first = roles[0]
        free = settled_free(lambda: free_devices(first.device, cfg.threads_per_worker, first.resources),
                            len(first.ranks))
        devices = er.fit(min(free, len(first.ranks)))
        if devices is None:
            raise PlacementError(f"elastic group {group!r} needs at least {er.smallest} devices and the cluster has "
                                 f"{free} free; add nodes, or lower min_gpus in its roles' elasticity")
        if devices != len(first.ranks):
            log.warning("elastic: %s starts on %d of its %d devices (the cluster has %d free); it grows as "
                        "devices join", group, devices, len(first.ranks), free)
            plan = resized(plan, group, devices, cfg)
            first = next(r for r in plan.roles if r.group == group)
        new = reserve(group, devices, first.device, cfg.threads_per_worker, share=len(roles),
                      resources=first.resources, packs=first.packs or None)
        bundles.update({r.role: new for r in roles})
    return plan, bundles


ELASTIC_SETTLE_S = 5.0
"""Seconds an elastic group waits for its full size before it starts smaller: devices released
just now (a run, or a test, that ended a moment ago) take Ray a moment to show as free."""


def settled_free(free: Callable[[], int], wanted: int, settle_s: float = ELASTIC_SETTLE_S) -> int:
    """`free()` once it reaches `wanted`, or after `settle_s` seconds of asking (every 0.2 s)."""
    deadline, have = time.monotonic() + settle_s, free()
    if have < wanted:
        log.info("elastic: %d of %d devices free; waiting up to %.0f s for more to show", have, wanted, settle_s)
    while have < wanted and time.monotonic() < deadline:
        time.sleep(0.2)
        have = free()
    return have


def reference_forward(models: Models, batch):
    """The reference's answer for `batch` (a Pending): the reference model's, or, when a LoRA run
    starts none, the actor's with its adapters off (the frozen base it started from)."""
    if getattr(models, "reference", None) is not None:
        return models.reference.forward(batch)
    return models.actor.forward(batch, adapters=False)


def _stop(model: WholeModel, role: str) -> None:
    try:  # on a lost node its Workhorses are gone or hang: no grace
        model.shutdown(release=False, grace_s=0.0)
    except Exception as exc:  # noqa: BLE001 - the model is going: report and go on
        log.warning("%s: stopping the model: %s", role, exc)


def _restarted(model: WholeModel, role_plan: RolePlan, devices: Bundles, kwargs: dict) -> bool:
    """Restart `model`'s Workhorses on `devices` in `role_plan`'s layout; False when its WholeModel
    actor is gone (a new WholeModel is needed)."""
    from ray.exceptions import RayActorError

    try:
        model.restart(role_plan.parallel, devices, kwargs)
        return True
    except RayActorError as exc:
        log.warning("%s: its WholeModel actor is gone (%s); starting a new WholeModel", role_plan.role,
                    str(exc).splitlines()[0])
        _stop(model, role_plan.role)
        return False


def rl_optimizer_steps(cfg: RunConfig) -> int:
    """The optimizer steps the actor (and critic) of an RL run take at most, the horizon of a
    decaying lr schedule: trainer.steps x ppo_epochs x the mini-batches of a step's samples
    (`ppo.target_kl` may stop epochs early; a supervised job sets its own, `algorithms/sft.py`)."""
    samples = cfg.ppo.rollout_batch_size * cfg.rollout.n_samples
    return cfg.trainer.steps * cfg.ppo.ppo_epochs * max(1, samples // cfg.ppo.mini_batch_size)


def role_init_kwargs(cfg: RunConfig, role: str, backend: str, model_dir: str) -> dict[str, Any]:
    """What a role's Workhorses are built with: its own config section, nothing more."""
    if role in ("rollout", "sampler"):
        r = cfg.rollout
        kwargs = dict(backend=backend, model_dir=model_dir, dtype=r.dtype or cfg.model.dtype,
                      max_model_len=cfg.data.max_prompt_tokens + response_tokens(cfg) + 8)
        if r.stop or cfg.env.name:  # both engines match stop strings on text: they load the model's tokenizer
            kwargs["stop_strings"] = True  # (an environment's, a tool call's closing tag: xray/run/episodes/runner.py)
        e = engine(backend)
        if e.memory_share:
            kwargs.update(kv_cache_gib=r.kv_cache_gib, gpu_memory_utilization=r.gpu_memory_utilization)
        if e.quant_schemes:
            kwargs["quantization"] = r.quantization  # the plan refused it for any other backend
        if e.lora_sync == "adapters" and role == "rollout" and cfg.actor.lora is not None:
            kwargs["lora"] = cfg.actor.lora  # it serves the actor's adapter, synced alone
        if e.sleeps and role == "rollout":  # the sampler never sleeps: nothing trains beside it
            kwargs["sleep_mode"] = rollout_sleeps(cfg, backend)
        if cfg.actor.moe.routing_replay and role == "rollout":  # dsinfer: the plan refused the others
            kwargs["report_routing"] = True
        return kwargs
    if role == "reward" or (role == "orm" and cfg.reward.model):
        return dict(model_dir=cfg.reward.model)
    if role == "orm":  # a reward function, with the policy's tokenizer to decode the candidates
        return dict(functions=list(cfg.reward.specs), weights=cfg.reward.weights, workers=cfg.reward.workers,
                    model_dir=model_dir, on_nonfinite=cfg.reward.on_nonfinite)
    if role == "prm":
        return dict(model_dir=cfg.sample.prm_model, steps=True)
    rc = getattr(cfg, role)
    optim = rc.optim.for_run(rl_optimizer_steps(cfg)) if role in ("actor", "critic") else rc.optim
    kwargs: dict[str, Any] = dict(backend=backend, model_dir=rc.model_path or model_dir, optim=optim,
                                  forward_micro_batch_size=rc.micro_batch_size, dtype=cfg.model.dtype)
    if engine(backend).zero:
        kwargs["zero_stage"] = rc.zero_stage
    if rc.max_tokens_per_micro_batch is not None:
        kwargs["max_tokens_per_micro_batch"] = rc.max_tokens_per_micro_batch
    if rc.packing:
        kwargs["packing"] = True
    if rc.lora is not None:
        kwargs["lora"] = rc.lora
    if rc.activation_checkpointing and role in ("actor", "critic"):
        kwargs["activation_checkpointing"] = True
    if rc.moe.balanced or rc.moe.routing_replay:
        kwargs["moe"] = rc.moe
    if role == "teacher":  # built and run as a reference is: frozen, no optimizer
        kwargs["engine_role"] = "reference"
    return kwargs


def check_layouts(cfg: RunConfig, plan: Plan, model_dir: str) -> None:
    """Layouts and lengths the model cannot take fail here, before any Workhorse starts."""
    import json
    from pathlib import Path

    from xray.backends import load_backend

    config_file = Path(model_dir) / "config.json"
    if config_file.is_file():
        limit = json.loads(config_file.read_text()).get("max_position_embeddings")
        needed = cfg.data.max_prompt_tokens + response_tokens(cfg) + 8  # the rollout's max_model_len
        room = "env.max_tokens" if cfg.env.episodes else "rollout.max_new_tokens"
        if limit is not None and needed > limit:
            raise ConfigError(f"data.max_prompt_tokens + {room} + 8 = {needed} exceeds the model's "
                              f"max_position_embeddings={limit}; lower {room} or data.max_prompt_tokens")
    teacher = cfg.teacher.model_path
    if any(r.role == "teacher" for r in plan.roles) and teacher and not teacher.startswith("builtin:"):
        check_teacher_vocab(teacher, model_dir)
    for r in plan.roles:
        if not engine(r.backend).checks_layout:
            continue
        directory = getattr(cfg, r.role).model_path or model_dir
        if directory.startswith("builtin:"):  # a built-in teacher: checked once built (`build_models`)
            continue
        try:
            load_backend(r.backend).check_layout(directory, r.parallel)
        except ValueError as exc:
            raise ConfigError(f"{r.role}: {exc}") from None


def check_teacher_vocab(teacher_dir: str, model_dir: str) -> None:
    """The teacher scores the student's token ids: both must have one vocabulary."""
    import json
    from pathlib import Path

    sizes = [json.loads((Path(d) / "config.json").read_text()).get("vocab_size")
             if (Path(d) / "config.json").is_file() else None for d in (teacher_dir, model_dir)]
    if None not in sizes and sizes[0] != sizes[1]:
        raise ConfigError(f"teacher.model_path has a vocabulary of {sizes[0]} tokens and the student {sizes[1]}: "
                          "the teacher scores the student's token ids, so give a teacher with the student's tokenizer")


def start_model(cfg: RunConfig, nproc_per_node: int, model_dir: str, role_plan: RolePlan, devices: Bundles,
                model: WholeModel | None = None) -> WholeModel:
    """One role's WholeModel on `devices` (reserved for its group): its init kwargs, the elastic
    micro-batch, CPU pinning (`pin_cpu_devices`). With `model`, its Workhorses restart there
    instead, unless its WholeModel actor is gone. Every job starts its models through here."""
    role = role_plan.role
    kwargs = role_init_kwargs(cfg, role, role_plan.backend, model_dir)
    if role in TRAINED and getattr(cfg, role).elasticity is not None:  # the elastic micro-batch and lr
        kwargs["forward_micro_batch_size"] = train_batches(cfg, {role: role_plan.num_workhorses}).micro_of(role)
        kwargs["optim"] = replace(kwargs["optim"], lr=role_lr(cfg, role, role_plan.num_workhorses))
    if cfg.pin_cpu_devices and role_plan.device.upper() == "CPU":
        kwargs["cpu_devices"] = [r % nproc_per_node for r in role_plan.ranks]
    if model is not None and _restarted(model, role_plan, devices, kwargs):
        return model
    return WholeModel(workhorse_class(role_plan.backend, role), role=role, parallel=role_plan.parallel,
                      device=role_plan.device, bundles=devices, seed=cfg.seed,
                      threads=cfg.threads_per_worker, init_kwargs=kwargs)


def join_cluster(cfg: RunConfig, plan: Plan, ray_address: str | None = None) -> None:
    """Join the Ray cluster at `ray_address`, or start a local one with a CPU slot per device thread."""
    from xray.wholemodel.cluster import ensure_ray

    ensure_ray(ray_address, num_cpus=plan.nproc_per_node * plan.nnodes * cfg.threads_per_worker)


def build_models(cfg: RunConfig, plan: Plan, model_dir: str, ray_address: str | None = None) -> Models:
    """Start every role's WholeModel on its device group."""
    check_layouts(cfg, plan, model_dir)
    join_cluster(cfg, plan, ray_address)
    from xray.wholemodel.handle import control_plane_placement
    from xray.workhorse.drain import open_inbox

    open_inbox(control_plane_placement(), cfg.trainer.drain_grace_s)  # SIGTERM: a notice (xray/workhorse/drain.py)
    plan, bundles = reserve_elastic(cfg, plan)

    def start(role_plan: RolePlan, devices: Bundles, model: WholeModel | None = None) -> WholeModel:
        return start_model(cfg, plan.nproc_per_node, model_dir, role_plan, devices, model)

    roles = [r.role for r in plan.roles]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(roles)) as pool:
        started = dict(zip(roles, pool.map(lambda r: start(plan.role(r), bundles[r]), roles)))
    log.info("started %s in %.0f s", ", ".join(f"{r} ({len(started[r].layout)} Workhorses)" for r in roles),
             time.perf_counter() - t0)
    models = Models(**started, bundles=bundles, plan=plan, starter=start, standby=cfg.trainer.standby_workhorses,
                    threads=cfg.threads_per_worker)
    models.keep_standby()  # they warm while the run's first step goes
    return models
