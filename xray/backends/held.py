"""The exact half of a weight sync's verification: does the engine hold what it was sent?

Used by the generation engines (`vllm.py`, `dsinfer.py`) right after they load a bucket, and
reported by the rollout Workhorse at the end of a sync (`xray/sync/weights.py` judges it). Each
engine tensor is compared bit for bit with the tensors it was sent, laid out as the engine lays
them out (vLLM's fused q/k/v and gate/up, its vocabulary padding, a tensor-parallel shard) and
cast to the engine's dtype the way its own load casts them (round to nearest). In bf16 this is
the only tight check there is: two bf16 implementations of one model differ in their log-probs
by as much as bf16 differs from fp32 (see FACTS.md), so the log-prob probe stays coarse there.

What an engine cannot read back is counted as unreadable, not passed: vLLM on CPU repacks every
linear layer's weight for oneDNN and drops the plain tensor from the module, so there only the
embeddings, norms and output layer can be compared; on GPU, and in DeepSpeed-Inference, all.

A quantized engine (`rollout.quantization`) holds its linear layers as fp8 codes and scales:
`compare_fp8` checks them against our own quantization of the tensors sent
(`xray/backends/quantize.py`), code for code and scale for scale; a difference is a mismatch
named with how much differs. vLLM on CPU keeps those codes readable, so every tensor is checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xray.backends.quantize import fp8_difference, fp8_per_channel


@dataclass
class HeldCheck:
    """Counts of an engine's tensors compared with what it was sent since the last `take`."""

    checked: int = 0
    """Engine tensors found equal, bit for bit, to the expected values."""
    unreadable: int = 0
    """Engine tensors that could not be compared (dropped after repacking, or laid out otherwise)."""
    mismatched: list[str] = field(default_factory=list)
    """Engine tensors that differ from what was sent."""

    def compare(self, name: str, held: torch.Tensor | None, expected: torch.Tensor) -> None:
        """Compare the engine's tensor `name` with `expected` (the sent values, laid out as held)."""
        same = held_equals(held, expected)
        if same is None:
            self.unreadable += 1
        elif same:
            self.checked += 1
        else:
            self.mismatched.append(name)

    def compare_fp8(self, name: str, held: torch.Tensor | None, held_scale: torch.Tensor | None,
                    expected: torch.Tensor, dtype: torch.dtype) -> None:
        """Compare the engine's per-channel fp8 layer `name` (codes `held` laid out `[K, N]`, as vLLM
        keeps them, and `held_scale` `[N, 1]`) with the reference quantization of `expected`
        `[N, K]` (the sent values, fused parts concatenated) cast to the engine's `dtype`."""
        if held is None or held_scale is None or held.dim() != 2 or \
                tuple(held.shape) != tuple(expected.shape[::-1]) or held_scale.numel() != expected.shape[0]:
            self.unreadable += 1  # missing, or another layout (a tensor-parallel shard, a repacked kernel)
            return
        codes, scale = fp8_per_channel(expected, dtype)
        diff = fp8_difference(codes, scale, held.detach().cpu().t(), held_scale.detach().cpu())
        if diff is None:
            self.checked += 1
        else:
            self.mismatched.append(f"{name} [{diff}]")

    def take(self) -> dict:
        """The counts so far as a dict (reset afterwards)."""
        out = {"checked": self.checked, "unreadable": self.unreadable, "mismatched": list(self.mismatched)}
        self.checked, self.unreadable, self.mismatched = 0, 0, []
        return out


def held_equals(held: torch.Tensor | None, expected: torch.Tensor) -> bool | None:
    """Whether `held` holds `expected` (cast to its dtype) exactly; a `held` with more rows holds
    it in its first rows (a padded vocabulary). None when `held` cannot be compared: missing,
    emptied, or of another shape."""
    if held is None or held.numel() == 0 or held.dim() != expected.dim():
        return None
    if tuple(held.shape[1:]) != tuple(expected.shape[1:]) or held.shape[0] < expected.shape[0]:
        return None
    held = held.detach()
    if held.device != expected.device:
        held = held.cpu()
    return torch.equal(held[:expected.shape[0]], expected.to(held.dtype))
