"""Scores from a reward model: the `reward` WholeModel behind the same interface as a function.

`ModelScorer(reward, pad_id)` is called like `xray.rewards.loader.RewardScorer`:
`(rows, response_ids) -> (scores [B], keep [B] or None)`; the prompt and response token ids are
packed as one right-padded batch and scored by the reward model's Workhorses.
"""
from __future__ import annotations

import torch

from xray.data.sequences import pack_sequences


class ModelScorer:
    """A reward WholeModel (RewardWorkhorse) as a score function."""

    def __init__(self, reward, pad_id: int, on_nonfinite: str = "error"):
        self.reward, self.pad_id, self.on_nonfinite = reward, pad_id, on_nonfinite

    def __call__(self, rows: list[dict], response_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = pack_sequences([r["prompt_ids"] for r in rows], response_ids, self.pad_id)
        scores = self.reward.score(batch.select(["input_ids", "attention_mask"])).get()
        keep = torch.isfinite(scores)
        if not bool(keep.all()):
            bad = int((~keep).nonzero()[0])
            if self.on_nonfinite != "skip":
                raise ValueError(f"the reward model scored row {bad} (prompt {rows[bad].get('prompt')!r}) as "
                                 f"{float(scores[bad])}; set reward.on_nonfinite=skip to drop such samples")
            return torch.where(keep, scores, torch.zeros_like(scores)), keep
        return scores, None
