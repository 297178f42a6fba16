"""The contract between the run machinery and an RL algorithm: all the run knows of one.

The run machinery (`xray/run/`: the step, the loop, the asynchronous trainer and makers, recovery)
is the same for every RL algorithm. An algorithm (`algorithms/`: PPO, the critic-free family, GSPO
or CISPO through a registered policy loss) hands it one picklable object meeting `Algorithm`,
built by its spec from the run's config; the synchronous step and the asynchronous trainer both
call the same `targets`, so advantages are computed in one place. A new algorithm is a new object
(and spec), not a new trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from xray.data.batch import Batch
from xray.sync.end_to_end import GapBound


@dataclass
class Experience:
    """What a step hands `Algorithm.targets`: the samples and everything scored on them.
    Per-token tensors are `[B, T-1]` over the response positions of `mask`."""

    exp: Batch
    """The samples (the rollout's columns)."""
    scores: torch.Tensor
    """`[B]` rewards of the samples, as scored (not shaped)."""
    mask: torch.Tensor
    """`[B, T-1]` the loss mask, rows dropped by the reward zeroed."""
    logprobs: torch.Tensor
    """The actor's log-probs of the samples (the old, or proximal, policy); zeros on an on-policy
    step that skips that forward."""
    ref_logprobs: torch.Tensor | None = None
    """The reference's, where the algorithm uses its KL."""
    values: torch.Tensor | None = None
    """The critic's, where the algorithm has one."""
    teacher_logprobs: torch.Tensor | None = None
    """The teacher's, with on-policy distillation's term."""
    valid: torch.Tensor | None = None
    """`[B]` rows kept in their group's statistics (None: all)."""


@dataclass(frozen=True)
class LossFacts:
    """What the run decides about the actor's loss: the algorithm builds it from these."""

    behaviour_weight_cap: float | None
    """Weigh each token by the truncated importance weight against the rollout's log-probs
    (asynchronous runs, a quantized rollout); None: not."""
    on_policy: bool = False
    """The batch's only update with the weights that sampled it: no separate old-policy forward."""
    routing: bool = False
    """The actor's forwards replay the rollout's expert routing."""
    end_to_end_bound: GapBound | None = None
    """Where the training forward carries the sync's end-to-end check (on-policy steps)."""


class Algorithm(Protocol):
    """An RL algorithm as the run machinery sees it (picklable: the asynchronous trainer, a Ray
    actor, receives it)."""

    name: str
    """The command's name (`ppo`, `grpo`, ...): the progress line and logs show it."""
    trained: tuple[str, ...]
    """The roles a step trains (and a checkpoint holds): ("actor", "critic") or ("actor",)."""
    kl_in: str
    """Where the KL to the reference goes: `reward`, `loss` or `none` (no reference runs)."""
    teacher_coef: float
    """The teacher's term's weight in the advantages (0: no teacher runs)."""
    skips_old_forward: bool
    """Whether an on-policy step may skip the actor's old-policy forward (no critic, no KL)."""

    def kl_controller(self) -> Any:
        """A fresh KL controller (`value`, `update`, `state_dict`, `load_state_dict`)."""

    def losses(self, facts: LossFacts) -> dict[str, Any]:
        """Each trained role's loss function (`xray.backends.base.LossFn`)."""

    def targets(self, e: Experience, kl_coef: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The train batch's algorithm columns (ADVANTAGES and what its losses read besides the
        samples' own: RETURNS, OLD_VALUES, REF_LOGPROBS) and its metrics (KL, distillation)."""

    def wants_more(self, rounds: list, groups: int) -> bool:
        """Whether a step that sampled `rounds` (`Sampled`) should sample another round of prompts
        (dynamic sampling) to fill `groups` groups."""

    def select(self, rounds: list, groups: int) -> tuple[Any, dict[str, float]]:
        """The step's samples out of several rounds, and the selection's metrics."""


@dataclass
class Sampled:
    """One round of a step's samples: the experience, its scores, the samples kept (None: all)
    and the answers of the forwards the step queued on them, by role (actor, reference, critic,
    teacher)."""

    exp: Batch
    scores: torch.Tensor
    keep: torch.Tensor | None
    answers: dict
