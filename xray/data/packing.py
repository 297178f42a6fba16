"""Sequence packing: a micro-batch's rows concatenated into one sequence without padding
(`<role>.packing`), each row with its own positions (from 0) and an attention that stays inside
its row, and the model's per-position outputs laid back out as the padded rows.

The engines run the packed sequence through the model (Megatron: its `thd` packed-sequence path,
the core attention looping over rows, `xray/backends/megatron/attention.py`; Hugging Face models
under DeepSpeed: position ids that restart at each row, which transformers reads as packed rows)
and `Pack.unpack` turns its `[1, T, ...]` output into `[b, W, ...]` as the padded forward gives it,
zeros past each row's end. Everything after the model (log-probs, values, losses) is unchanged,
so packing changes no result: what a row's positions see is what they see padded.

Rows are left-aligned (`xray.data.columns`): row i is `ids[i, :L_i]`. Packing pays where lengths
differ: a padded micro-batch computes rows x its longest row, a packed one the sum of the rows
(`xray.data.budget` cuts packed micro-batches by that sum).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pack:
    """One packed micro-batch: model inputs and the map back to rows."""

    ids: torch.Tensor
    """[1, T] the rows' tokens, one after another (T = the sum of the rows' lengths)."""
    positions: torch.Tensor
    """[1, T] each token's position in its own row."""
    cu_seqlens: torch.Tensor
    """[b + 1] int32 offsets of the rows in the packed sequence (0, L_0, L_0 + L_1, ...)."""
    max_len: int
    """The longest row."""
    index: torch.Tensor
    """[b, W] the packed position of each row's position (0 where the row has ended)."""
    valid: torch.Tensor
    """[b, W] True at each row's real positions."""

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """A packed model output `[1, T, ...]` as padded rows `[b, W, ...]` (zeros past each row)."""
        rows = out[0][self.index]
        mask = self.valid.reshape(*self.valid.shape, *([1] * (rows.dim() - 2)))
        return rows * mask.to(rows.dtype)


def pack_rows(ids: torch.Tensor, attention_mask: torch.Tensor) -> Pack:
    """The rows of `ids` ([b, W], left-aligned, `attention_mask` 1 on real tokens) packed."""
    lengths = attention_mask.sum(1).long()
    if bool((lengths < 1).any()):
        raise ValueError("packing needs every row to hold at least one token; drop empty rows first")
    valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
    starts = torch.cumsum(lengths, 0) - lengths
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = torch.cumsum(lengths, 0)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    index = torch.where(valid, starts[:, None] + positions, torch.zeros_like(positions))
    return Pack(ids[valid][None], positions[valid][None], cu, int(lengths.max()), index, valid)
