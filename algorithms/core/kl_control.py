"""KL controllers (trlX / Ziegler et al. 2019): the coefficient of the per-token KL penalty
(`algorithms/core`, the shared RL math).

Adaptive: after each PPO step with measured KL `current` over `n_steps` samples,

    error = clip(current / target - 1, -0.2, 0.2)
    kl_coef *= 1 + error * n_steps / horizon

Fixed: the coefficient never changes. Both save and load their state for an exact resume.
`current` is the k1 estimate summed over each response, averaged over the batch
(`algorithms.core.kl_estimators.kl_metrics`'s `kl_sequence`), so `ppo.kl_target` is in nats
per sequence.
"""
from __future__ import annotations

from typing import Any, Optional, Union



class KLStateError(ValueError):
    """A saved KL-controller state that does not fit this controller."""


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """trlX's proportional controller that steers the measured KL towards `target`."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, "
                             f"horizon={horizon}; set ppo.kl_target to null for a fixed coefficient")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current: float, n_steps: int) -> None:
        """Move the coefficient after a step whose measured KL was `current` over `n_steps` samples."""
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "adaptive")
        if (state["target"], state["horizon"]) != (self.target, self.horizon):
            raise KLStateError(f"the saved KL controller had target={state['target']}, horizon={state['horizon']}; "
                               f"this run has target={self.target}, horizon={self.horizon}: resume with the "
                               "same ppo.kl_target and ppo.kl_horizon")
        self.value = float(state["value"])


KLController = Union[FixedKLController, AdaptiveKLController]


def build_kl_controller(kl_coef: float, kl_target: Optional[float], kl_horizon: int) -> KLController:
    """Adaptive when `kl_target` is set (PPOConfig.kl_target), else fixed."""
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon)


def _check_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise KLStateError(f"the saved KL controller is {state.get('kind')!r}, this run's is {kind!r}: "
                           "resume with the same ppo.kl_target setting (null means fixed)")
