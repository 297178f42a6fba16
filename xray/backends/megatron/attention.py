"""A core-attention module for Megatron's layer spec that runs torch's fused SDPA kernel.

Used by `model.py` in the `core_attention` slot of Megatron's local GPT layer spec (the slot
Transformer Engine's attention fills on GPUs that have it). Megatron's local `DotProductAttention`
materialises the scores with `baddbmm`, masks and soft-maxes them, then `bmm`s: on CPU that costs
about 1.5x torch's `scaled_dot_product_attention`, which has a fused kernel on CPU and on GPU.
Same inputs and outputs as Megatron's: q [sq, b, heads, d], k/v [sk, b, groups, d] (this rank's
heads), Megatron's boolean mask (True = blocked) -> [sq, b, heads * d]. No dropout (the engine
trains with dropout 0). Packed rows (Megatron's `thd` layout, `xray/data/packing.py`) attend
inside their own row, one row at a time. Also here: the engine's padded attention mask
(`attention_mask`) and its packed-sequence description (`packed_params`).

On CPU, bf16 (or fp16) attention runs in fp32 and casts back: torch's CPU flash-attention backward
in bf16 took 32 ms of a 96 ms train step of vs_trl's small model (8 ms a layer), against 7 ms in
fp32, and the attention's share of the FLOPs is small, so the cast is the cheaper path (and the
more precise one).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from xray.data.packing import Pack


class SDPAttention(torch.nn.Module):
    """Grouped-query attention through `F.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; set cp=1")
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.attn_mask_type = attn_mask_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.heads != self.groups:  # each group's k/v serve heads // groups query heads
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, heads, s, d]
        allowed = None if attention_mask is None else ~attention_mask
        dtype = q.dtype
        if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                             scale=self.scale).to(dtype)  # [b, heads, sq, d]
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Megatron's `thd` layout (q [t, heads, d], k/v [t, groups, d], the rows one after
        another at `params.cu_seqlens_q`): causal attention inside each row, row by row, so a
        packed micro-batch costs the sum of its rows' attention, not the square of their sum."""
        if params.qkv_format != "thd" or not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("SDPAttention packs self-attention rows in the 'thd' layout only")
        bounds = params.cu_seqlens_q.tolist()
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].permute(1, 0, 2)[None] for t in (query, key, value))  # [1, h, L, d]
            if self.heads != self.groups:
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
            dtype = q.dtype
            if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
                q, k, v = q.float(), k.float(), v.float()
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).to(dtype)
            out.append(o[0].permute(1, 0, 2).reshape(end - start, -1))  # [L, heads * d]
        return torch.cat(out)


def attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask [b, 1, T, T], True where attention is blocked: future keys and
    padding keys (so padded positions see exactly what Hugging Face's masked attention shows)."""
    T = valid.shape[1]
    future = torch.ones(T, T, dtype=torch.bool, device=valid.device).triu(1)
    keys = valid != 0
    keys[:, 0] |= ~keys.any(dim=1)  # an all-padding row still attends to its first token (no NaN)
    return future[None, None] | ~keys[:, None, None, :]


def packed_params(pack: Pack):
    """Megatron's description of a packed micro-batch (the `thd` layout)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=pack.cu_seqlens, cu_seqlens_kv=pack.cu_seqlens,
                           max_seqlen_q=pack.max_len, max_seqlen_kv=pack.max_len)
