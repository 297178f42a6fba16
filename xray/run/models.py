"""Build the WholeModels of a run from its config and placement plan.

Each role gets its section of the config and the bundles of its device group (roles of one group
share devices). Models start concurrently: each WholeModel's Workhorses build while the others
build, so a run's start-up costs about its slowest model, not the sum.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from xray.config.plan import Plan
from xray.config.schema import RunConfig
from xray.config.typed import ConfigError
from xray.wholemodel import WholeModel
from xray.wholemodel.placement import reserve_plan
from xray.workhorse.roles import workhorse_class

log = logging.getLogger(__name__)


@dataclass
class Models:
    """The WholeModels of a PPO run."""

    actor: WholeModel
    critic: WholeModel
    reference: WholeModel
    rollout: WholeModel
    reward: Optional[WholeModel] = None
    placement_groups: tuple = ()
    """The run's device reservations, freed by `shutdown`."""

    def all(self) -> list[WholeModel]:
        return [m for m in (self.actor, self.critic, self.reference, self.rollout, self.reward) if m is not None]

    def shutdown(self) -> None:
        import ray

        for m in self.all():
            m.shutdown()
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


def role_init_kwargs(cfg: RunConfig, role: str, backend: str, model_dir: str) -> dict[str, Any]:
    """What a role's Workhorses are built with: its own config section, nothing more."""
    if role == "rollout":
        r = cfg.rollout
        kwargs = dict(backend=backend, model_dir=model_dir, dtype=r.dtype,
                      max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens + 8)
        if backend == "vllm":
            kwargs["kv_cache_gib"] = r.kv_cache_gib
        return kwargs
    if role == "reward":
        return dict(model_dir=cfg.reward.model)
    rc = getattr(cfg, role)
    kwargs: dict[str, Any] = dict(backend=backend, model_dir=rc.model_path or model_dir, optim=rc.optim,
                                  forward_micro_batch_size=rc.micro_batch_size)
    if backend == "deepspeed":
        kwargs["zero_stage"] = rc.zero_stage
    return kwargs


def check_layouts(cfg: RunConfig, plan: Plan, model_dir: str) -> None:
    """Layouts the model cannot take fail here, before any Workhorse starts."""
    from xray.backends import load_backend

    for r in plan.roles:
        if r.backend != "megatron":
            continue
        directory = getattr(cfg, r.role).model_path or model_dir
        try:
            load_backend("megatron").check_layout(directory, r.parallel)
        except ValueError as exc:
            raise ConfigError(f"{r.role}: {exc}") from None


def build_models(cfg: RunConfig, plan: Plan, model_dir: str, ray_address: str | None = None) -> Models:
    """Start every role's WholeModel on its device group."""
    from xray.wholemodel.cluster import ensure_ray

    check_layouts(cfg, plan, model_dir)
    ensure_ray(ray_address, num_cpus=plan.nproc_per_node * plan.nnodes * cfg.threads_per_worker)
    bundles = reserve_plan(plan, cfg.threads_per_worker)

    def start(role_plan) -> tuple[str, WholeModel]:
        role = role_plan.role
        kwargs = role_init_kwargs(cfg, role, role_plan.backend, model_dir)
        if cfg.pin_cpu_devices and role_plan.device.upper() == "CPU":
            kwargs["cpu_devices"] = [r % plan.nproc_per_node for r in role_plan.ranks]
        wm = WholeModel(workhorse_class(role_plan.backend, role), role=role, parallel=role_plan.parallel,
                        device=role_plan.device, bundles=bundles[role], seed=cfg.seed,
                        threads=cfg.threads_per_worker, init_kwargs=kwargs)
        return role, wm

    groups = tuple({id(b.placement_group): b.placement_group for b in bundles.values()}.values())
    with ThreadPoolExecutor(max_workers=len(plan.roles)) as pool:
        started = dict(pool.map(start, plan.roles))
    return Models(**started, placement_groups=groups)
