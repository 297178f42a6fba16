"""The per-token reward (`algorithms/core`, the shared RL math): a KL penalty on every response
token, plus the sequence's score on its last response token (trlX's `make_experience`).

    rewards[t] = -kl_coef * (logprobs[t] - ref_logprobs[t])     on response positions
    rewards[last] += shaped score                               last response position per row
    shaped score = clip(score * scale, -clip, clip) + overlong penalty

The overlong penalty is DAPO's soft overlong punishment (`reward.overlong_buffer`): 0 for a
response of at most `limit - buffer` tokens, then falling linearly to `-reward.overlong_penalty`
at the length limit (veRL's `overlong_buffer`).

All tensors are `[B, T-1]` in the "predict token t+1" layout; `mask` is `LOSS_MASK` (1 on the
positions that predict a response token, one contiguous span per row; an all-zero row is a
dropped sample).
"""
from __future__ import annotations

from typing import Optional

import torch


def shape_scores(scores: torch.Tensor, scale: float = 1.0, clip: Optional[float] = None) -> torch.Tensor:
    """Scores `[B]` multiplied by `scale`, then clipped to `[-clip, clip]` when `clip` is set."""
    if clip is not None and clip <= 0:
        raise ValueError(f"reward clip must be positive or null, got {clip}; set reward.clip to null to disable it")
    shaped = scores.float() * scale
    return shaped.clamp(-clip, clip) if clip is not None else shaped


def overlong_penalty(lengths: torch.Tensor, limit: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment `[B]` of responses `lengths` tokens long under a `limit`:
    0 up to `limit - buffer`, then linearly down to `-penalty` at the limit (and beyond)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (limit - buffer)) / buffer
    return -penalty * over.clamp(0.0, 1.0)


def run_scores(scores: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """A run's shaped scores `[B]` (a `RunConfig`): scaled and clipped (`shape_scores`), plus the
    overlong penalty of each response's loss-mask tokens under the run's length limit."""
    from xray.config.env import response_tokens

    r = cfg.reward
    shaped = shape_scores(scores, r.scale, r.clip)
    return shaped + overlong_penalty(mask.sum(1), response_tokens(cfg), r.overlong_buffer, r.overlong_penalty)


def last_response_index(mask: torch.Tensor) -> torch.Tensor:
    """Index `[B]` of each row's last masked position; -1 for a row with none."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, -1).max(dim=1).values


def kl_penalized_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                         scores: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards `[B, T-1]`: `-kl_coef * (logprobs - ref_logprobs)` on response positions
    (0 elsewhere), with `scores` `[B]` (already shaped) added at each row's last response token.
    A row whose mask is empty (a sample dropped for a non-finite score) gets no reward at all."""
    m = mask.to(logprobs.dtype)
    rewards = -kl_coef * (logprobs - ref_logprobs) * m
    last = last_response_index(mask)
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] += scores.to(rewards.dtype)[rows]
    return rewards
