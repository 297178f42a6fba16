"""Packed rows in a Hugging Face model: an attention that keeps each packed row to itself, one row
at a time (`xray/data/packing.py`; the DeepSpeed engine's `<role>.packing`).

transformers already reads packed rows from position ids that restart at 0 (with no attention
mask it builds a block-diagonal causal mask), but its sdpa attention then computes the square of
the packed length and masks most of it away. `ROWS`, registered with transformers' attention and
mask interfaces, runs SDPA on each row alone when the forward is given the rows' offsets
(`cu_seq_lens_q`, the keyword flash-attention models read), so a packed micro-batch costs the sum
of its rows' attention; without them it is transformers' sdpa attention, unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = "xray_rows"
"""The attention implementation's name (`model.set_attn_implementation(ROWS)`)."""


def rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [1, heads, T, d], k/v [1, kv_heads, T, d] ->
    ([1, T, heads, d], None); causal inside each row of `kwargs["cu_seq_lens_q"]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed rows come as one sequence, got a batch of {query.shape[0]}")
    repeat = query.shape[1] // key.shape[1]
    bounds = cu.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        k, v = key[:, :, start:end], value[:, :, start:end]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out.append(F.scaled_dot_product_attention(query[:, :, start:end], k, v, is_causal=True, scale=scaling,
                                                  dropout_p=dropout if module.training else 0.0))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def use_rows_attention(model: torch.nn.Module) -> None:
    """Register `ROWS` (once) and switch the Hugging Face `model` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROWS, rows_attention)
    AttentionMaskInterface.register(ROWS, sdpa_mask)
    model.set_attn_implementation(ROWS)
