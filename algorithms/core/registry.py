"""Policy losses and advantage estimators by name (`algorithms/core`, the shared RL math): the shape
of veRL's `register_policy_loss` / `register_adv_est`, so that a new objective is one registered
function plus one config literal.

    @register_policy_loss("gspo")
    def gspo_policy_loss(logprobs, old_logprobs, advantages, mask, loss, weight, norm):
        ...                                       # -> (loss scalar, {"clipfrac", "approx_kl", "ratio", ...})

    @register_adv_est("grpo")
    def grpo(inp: AdvantageInputs):
        ...                                       # -> (advantages [B, T-1], returns [B, T-1] or None)

A policy loss reads `[B, T-1]` log-probs under the policy being trained (with gradient) and the
old policy, the advantages and the 0/1 `mask`; `loss` is the `PolicyLoss` that calls it (its
`cliprange`, `cliprange_high`, `loss_agg_mode`); `weight` decoupled PPO's behaviour weight per
token or None; `norm` the slice's denominators of a length-grouped micro-batch (`aggregate`).

The lookups import the modules that register (`POLICY_LOSS_MODULES`, `ADV_ESTIMATOR_MODULES`)
first, so a name resolves in any process: a Ray worker that only unpickled a `PolicyLoss` finds
"gspo" without having imported `algorithms.policy_losses.gspo`. A loss or estimator of your own
registers when its module is imported; add the module to these lists to make it resolve there too.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from algorithms.core.advantage_inputs import AdvantageInputs

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""`fn(logprobs, old_logprobs, advantages, mask, loss, weight, norm) -> (loss, stats)`: the tensors
`[B, T-1]`, `loss` the calling `algorithms.core.policy_loss.PolicyLoss` (not imported here: it
imports this module), `weight` a tensor or None, `norm` an `xray.data.lengths.LossNorm` or None;
`stats` holds at least `clipfrac`, `approx_kl` and `ratio` (0-d tensors, no gradient)."""
AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, Optional[torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Registered policy losses by name."""
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Registered advantage estimators by name."""

POLICY_LOSS_MODULES = ("algorithms.policy_losses.vanilla", "algorithms.policy_losses.gspo",
                       "algorithms.policy_losses.cispo")
"""The modules that register the built-in policy losses (imported by `policy_loss_fn`)."""
ADV_ESTIMATOR_MODULES = ("algorithms.ppo.gae", "algorithms.critic_free.advantages", "algorithms.core.teacher")
"""The modules that register the built-in advantage estimators (imported by `adv_estimator`)."""


def _register(table: dict, kind: str, name: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        old = table.get(name)
        if old is not None and _qualname(old) != _qualname(fn):  # the same function re-imported is fine
            raise ValueError(f"{kind} {name!r} is already registered ({_qualname(table[name])}); "
                             f"register {_qualname(fn)} under another name")
        table[name] = fn
        return fn
    return decorator


def _qualname(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under `name` (a second, different function under the
    same name is an error; re-importing the same module is not)."""
    return _register(POLICY_LOSSES, "policy loss", name)


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register an advantage estimator under `name` (as `register_policy_loss`)."""
    return _register(ADV_ESTIMATORS, "advantage estimator", name)


def _import_all(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)


def policy_loss_names() -> tuple[str, ...]:
    """Every registered policy loss's name, sorted (the built-in modules imported first)."""
    _import_all(POLICY_LOSS_MODULES)
    return tuple(sorted(POLICY_LOSSES))


def adv_estimator_names() -> tuple[str, ...]:
    """Every registered advantage estimator's name, sorted (the built-in modules imported first)."""
    _import_all(ADV_ESTIMATOR_MODULES)
    return tuple(sorted(ADV_ESTIMATORS))


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; a ValueError listing the registered names if none."""
    if name not in POLICY_LOSSES:
        _import_all(POLICY_LOSS_MODULES)
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {', '.join(sorted(POLICY_LOSSES))} "
                         "(ppo.policy_loss), or register yours with algorithms.core.registry.register_policy_loss")
    return POLICY_LOSSES[name]


def adv_estimator(name: str) -> AdvantageFn:
    """The advantage estimator registered as `name`; a ValueError listing the registered names if none."""
    if name not in ADV_ESTIMATORS:
        _import_all(ADV_ESTIMATOR_MODULES)
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {', '.join(sorted(ADV_ESTIMATORS))}, "
                         "or register yours with algorithms.core.registry.register_adv_est")
    return ADV_ESTIMATORS[name]
