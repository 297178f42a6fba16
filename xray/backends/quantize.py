"""Quantized rollout weights (`rollout.quantization`): what each device's vLLM offers, the scheme
vLLM knows it by, and our own reference of the per-channel fp8 quantization vLLM applies.

Read by the plan (`xray/config/plan.py`: refuse what a device does not offer, before anything
starts), by the vLLM engine (`xray/backends/vllm.py`: build with the scheme, then compare what it
holds after every sync), and by the held check (`xray/backends/held.py`). No vLLM import here.

The reference (`fp8_per_channel`) follows vLLM's online `fp8_per_channel` arithmetic step by
step, so that an engine that quantized the tensors it was sent holds exactly its result, code for
code and scale for scale: per output channel (row), amax = max |w| over the row (in the engine's
dtype), scale = amax (fp32) / 448 floored at 1 / (448 x 512), codes = w / scale (a true fp32
division) clamped to +-448 and rounded to float8_e4m3fn. What an engine holds is compared with
it in `held.HeldCheck.compare_fp8`.
"""
from __future__ import annotations

import torch

QUANTIZATIONS = ("none", "fp8", "int8")
"""The values of `rollout.quantization`."""

VLLM_SCHEMES = {
    "cpu": {"fp8": "fp8_per_channel"},
    # vLLM's online fp8 on GPU: `fp8` no longer quantizes online, `fp8_per_tensor` does (with a
    # Marlin fallback on GPUs without fp8). Not run here (no vLLM on the lent GPU machine).
    "cuda": {"fp8": "fp8_per_tensor"},
}
"""Per device, each supported `rollout.quantization` and the vLLM scheme that implements it."""

CHECKED_SCHEMES = ("fp8_per_channel",)
"""Schemes whose held weights are compared with our reference; a layer quantized otherwise is
counted as unreadable (not passed)."""

WHY_NOT = {
    "int8": "vLLM's int8 (W8A8) runs from a prepared checkpoint (llmcompressor, not installed), and an "
            "int8 engine whose weights are reloaded in place gives NaN without an error: each sync would "
            "have to rebuild the engine (2-6 s)",
}
"""Why a quantization is refused everywhere (`offered` lists what is left)."""

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""float8_e4m3fn's largest finite value."""
QUANT_DTYPES = ("bfloat16", "float16")
"""The engine dtypes vLLM quantizes from online (float32 is refused when the engine is built)."""


def offered(device: str) -> tuple[str, ...]:
    """The `rollout.quantization` values a vLLM rollout on `device` (cpu or cuda) supports."""
    return ("none", *VLLM_SCHEMES[device])


def vllm_scheme(quantization: str, device: str) -> str | None:
    """The vLLM `quantization=` argument for `rollout.quantization` on `device` (None: unquantized).
    ValueError, saying what the device offers, for anything else."""
    if quantization == "none":
        return None
    scheme = VLLM_SCHEMES.get(device, {}).get(quantization)
    if scheme is None:
        why = WHY_NOT.get(quantization, "it is not implemented")
        raise ValueError(f"rollout.quantization={quantization} is unsupported on {device} ({why}); "
                         f"this device offers: {', '.join(offered(device))}")
    return scheme


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
