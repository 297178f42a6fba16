"""Best-of-N: where a response's steps end, and how one prompt's N candidates are ranked and chosen.

The sample job (`algorithms/sample.py`) scores every candidate with an outcome reward (`orm`, one
number per response) and optionally a process reward model (`prm`, one probability per step), and
keeps what this module decides, as ms-swift's sampler does: candidates are ranked by
`orm_weight x orm + prm`, where a response's PRM score is its weakest step's (a chain of reasoning
is as good as its worst step); a candidate passes when its ORM and PRM scores reach the
thresholds set; `best` keeps the top `n_best` that pass, each with the lowest-ranked candidate as
its `rejected` twin when that one scores lower. Pure functions of tensors and token ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


class StepSplitter:
    """Where the steps of a response end: at each token whose text holds `separator`, and at the
    response's last token before its stop tokens. Each token id is decoded once."""

    def __init__(self, tokenizer, separator: str, stop_ids: Sequence[int]):
        self.tokenizer, self.separator, self.stop_ids = tokenizer, separator, set(stop_ids)
        self._ends: dict[int, bool] = {}

    def _is_end(self, token: int) -> bool:
        if token not in self._ends:
            self._ends[token] = self.separator in self.tokenizer.decode([token])
        return self._ends[token]

    def ends(self, prompt_len: int, response: Sequence[int]) -> list[int]:
        """Positions in prompt + response of each step's last token (none for an empty response)."""
        content = list(response)
        while content and content[-1] in self.stop_ids:
            content.pop()
        ends = [prompt_len + j for j, t in enumerate(content) if self._is_end(t)]
        last = prompt_len + len(content) - 1
        if content and (not ends or ends[-1] != last):
            ends.append(last)
        return ends


def padded_ends(ends: Sequence[Sequence[int]]) -> torch.Tensor:
    """Step ends of a batch as `[B, S]` long, -1 past each row's last step (S >= 1)."""
    width = max(1, max((len(e) for e in ends), default=0))
    out = torch.full((len(ends), width), -1, dtype=torch.long)
    for i, e in enumerate(ends):
        out[i, :len(e)] = torch.tensor(list(e), dtype=torch.long)
    return out


def weakest_step(step_scores: torch.Tensor) -> torch.Tensor:
    """A response's PRM score: its lowest step score `[B, S] -> [B]` (NaN marks no step; a response
    with no step scores 0)."""
    filled = torch.where(torch.isnan(step_scores), torch.full_like(step_scores, math.inf), step_scores)
    low = filled.min(dim=1).values
    return torch.where(torch.isinf(low), torch.zeros_like(low), low)


@dataclass(frozen=True)
class Ranking:
    """One prompt's candidates, ranked."""

    score: torch.Tensor
    """[N] `orm_weight x orm + prm`; -inf where the outcome reward gave no score."""
    passed: torch.Tensor
    """[N] bool: a score, and the thresholds met."""
    order: list[int]
    """Candidate indices from the highest score to the lowest (ties: the earlier candidate first)."""

    def best(self, n_best: int) -> list[tuple[int, Optional[int]]]:
        """Up to `n_best` (chosen, rejected) pairs: the top candidates that passed, each with the
        lowest-ranked scored candidate when it scores strictly lower (else None)."""
        scored = [i for i in self.order if math.isfinite(float(self.score[i]))]
        worst = scored[-1] if scored else None
        chosen = [i for i in self.order if bool(self.passed[i])][:n_best]
        return [(i, worst if worst is not None and float(self.score[worst]) < float(self.score[i]) else None)
                for i in chosen]


def rank_candidates(orm: Optional[torch.Tensor], prm: Optional[torch.Tensor], orm_weight: float,
                    orm_threshold: Optional[float] = None, prm_threshold: Optional[float] = None) -> Ranking:
    """Rank one prompt's candidates by their outcome scores `orm` [N] (NaN: none) and PRM scores
    `prm` [N] (weakest steps); either may be absent (None), then it adds nothing and filters none."""
    n = len(orm) if orm is not None else len(prm) if prm is not None else 0
    if n == 0:
        raise ValueError("rank_candidates needs the orm or the prm scores of at least one candidate")
    score, passed = torch.zeros(n), torch.ones(n, dtype=torch.bool)
    if orm is not None:
        orm = orm.float()
        passed &= ~torch.isnan(orm)
        score = score + orm_weight * torch.nan_to_num(orm, nan=0.0)
        if orm_threshold is not None:
            passed &= torch.nan_to_num(orm, nan=-math.inf) >= orm_threshold
    if prm is not None:
        score = score + prm.float()
        if prm_threshold is not None:
            passed &= prm.float() >= prm_threshold
    if orm is not None:
        score = torch.where(torch.isnan(orm), torch.full_like(score, -math.inf), score)
    order = sorted(range(n), key=lambda i: (-float(score[i]), i))
    return Ranking(score, passed, order)
