"""Scores from a reward model: the `reward` WholeModel behind the interface the algorithms use.

`ModelScorer(reward)` is awaited as `await scorer.ascore(rows, generated)`, where
`generated` is the rollout's answer (a `Pending` with the packed INPUT_IDS / ATTENTION_MASK of
prompt + response): the reward model's Workhorses read it by reference, straight from the rollout's
Workhorses, and only the scores `[B]` come back.
"""
from __future__ import annotations

import torch



class ModelScorer:
    """A reward WholeModel (RewardWorkhorse) as a score function."""

    def __init__(self, reward, on_nonfinite: str = "error"):
        self.reward, self.on_nonfinite = reward, on_nonfinite

    async def ascore(self, rows: list[dict], generated) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores of the rollout's answer `generated`, passed to the reward model by reference."""
        return self._checked(rows, await self.reward.score(generated))

    def _checked(self, rows: list[dict], scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        keep = torch.isfinite(scores)
        if not bool(keep.all()):
            bad = int((~keep).nonzero()[0])
            if self.on_nonfinite != "skip":
                raise ValueError(f"the reward model scored row {bad} (prompt {rows[bad].get('prompt')!r}) as "
                                 f"{float(scores[bad])}; set reward.on_nonfinite=skip to drop such samples")
            return torch.where(keep, scores, torch.zeros_like(scores)), keep
        return scores, None
