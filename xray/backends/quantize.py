"""Quantized rollout weights (`rollout.quantization`): our own reference of the per-channel fp8
quantization vLLM applies, and the comparison of what an engine holds with it.

Which schemes each device's vLLM offers, and from which dtypes, are facts of the engine registry
(`xray/config/engines.py`: read by the plan, to refuse what a device does not offer before
anything starts, and by the vLLM engine, `xray/backends/vllm.py`, to build with the scheme). This
module is read by the held check (`xray/backends/held.py`, `xray/backends/vllm_held.py`) after
every sync. No vLLM import here.

The reference (`fp8_per_channel`) follows vLLM's online `fp8_per_channel` arithmetic step by
step, so that an engine that quantized the tensors it was sent holds exactly its result, code for
code and scale for scale: per output channel (row), amax = max |w| over the row (in the engine's
dtype), scale = amax (fp32) / 448 floored at 1 / (448 x 512), codes = w / scale (a true fp32
division) clamped to +-448 and rounded to float8_e4m3fn. What an engine holds is compared with
it in `held.HeldCheck.compare_fp8`.
"""
from __future__ import annotations

import torch

from xray.config.engines import engine

CHECKED_SCHEMES = engine("vllm").quant_verified
"""Schemes whose held weights are compared with our reference (the engine registry's fact: a
verified sync refuses the others); a layer quantized otherwise is counted as unreadable."""

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value."""


def fp8_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8 of a linear layer's `weight` `[N, K]` as an engine of `dtype` makes
    it: (codes `[N, K]` float8_e4m3fn, scales `[N, 1]` fp32), dequantized as codes x scale."""
    w = weight.detach().to(dtype)
    low, high = w.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(low.abs(), high.abs()).to(torch.float32)
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=w.device)
    scale = (amax / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    codes = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def fp8_difference(codes: torch.Tensor, scale: torch.Tensor, held_codes: torch.Tensor,
                   held_scale: torch.Tensor) -> str | None:
    """How an engine's fp8 weight (`held_codes` `[N, K]`, `held_scale` `[N, 1]`) differs from the
    reference (`codes`, `scale`): None when identical code for code and scale for scale, else a
    short description (codes and scales that differ, max |dequantized difference|)."""
    same_codes = codes.view(torch.uint8) == held_codes.view(torch.uint8)
    same_scale = scale.reshape(-1) == held_scale.reshape(-1).to(scale.dtype)
    if bool(same_codes.all()) and bool(same_scale.all()):
        return None
    ours = codes.to(torch.float32) * scale.reshape(-1, 1)
    theirs = held_codes.to(torch.float32) * held_scale.reshape(-1, 1).to(torch.float32)
    worst = float((ours - theirs).abs().nan_to_num(float("inf")).max())
    return (f"fp8: {int((~same_codes).sum())}/{codes.numel()} codes and {int((~same_scale).sum())}/"
            f"{scale.numel()} scales differ, max |dequantized difference| {worst:.3g}")
