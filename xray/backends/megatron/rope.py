"""RoPE as a Hugging Face config sets it, for the Megatron engine: the base, and Llama 3's scaling.

Sits beside `spec.py` (which reads a config's RoPE with `read_rope` into the `ModelSpec`) and is
used by `model.py`: Megatron-core's `RotaryEmbedding` computes plain RoPE frequencies from the
base, and its own Llama 3 option fixes three of the four parameters (low and high frequency
factors 1 and 4, 8192 original positions), so for a `llama3` config `build_gpt` installs the
frequencies of `llama3_inverse_frequencies` instead, computed by the rule transformers applies
(`rope_type: llama3` in `rope_parameters`, transformers 5, or `rope_scaling`, earlier). Other
RoPE types are refused with the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "llama3")
"""The `rope_type`s the Megatron engine builds."""


class UnsupportedRopeError(ValueError):
    """A RoPE the Megatron engine does not build; the message says what is supported."""


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequency scaling: wavelengths longer than the original context divided by
    `factor`, shorter ones than original / high_freq_factor kept, a smooth blend between."""

    factor: float
    """Divisor of the low frequencies."""
    low_freq_factor: float
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int
    """The context length of pre-training the wavelengths are measured against."""


def read_rope(cfg: dict) -> tuple[float, Llama3Scaling | None]:
    """(RoPE base, Llama 3 scaling or None) of a config.json's dict."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"  # `type`: configs before transformers 4.45
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"RoPE type {rope_type!r} is not supported by the Megatron engine; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}. Use the deepspeed backend for this model.")
    if rope_type == "default":
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if rope.get(k) is None]
    if missing:
        raise UnsupportedRopeError(f"a llama3 RoPE needs {', '.join(keys)} in rope_parameters; this config lacks "
                                   f"{', '.join(missing)}: add them (the model's card gives them)")
    scaling = Llama3Scaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                            int(rope["original_max_position_embeddings"]))
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise UnsupportedRopeError(f"llama3 RoPE with high_freq_factor={scaling.high_freq_factor} not above "
                                   f"low_freq_factor={scaling.low_freq_factor}; fix the config")
    return theta, scaling


def llama3_inverse_frequencies(theta: float, head_dim: int, scaling: Llama3Scaling):
    """The [head_dim / 2] fp32 inverse frequencies of RoPE with base `theta`, scaled Llama 3's way."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    plain = 1.0 / (theta ** exponents)
    wavelength = 2 * math.pi / plain
    context = scaling.original_max_position_embeddings
    longest_kept = context / scaling.high_freq_factor  # shorter wavelengths: unchanged
    shortest_scaled = context / scaling.low_freq_factor  # longer wavelengths: divided by factor
    scaled = torch.where(wavelength > shortest_scaled, plain / scaling.factor, plain)
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    between = (wavelength >= longest_kept) & (wavelength <= shortest_scaled)
    return torch.where(between, blended, scaled)
