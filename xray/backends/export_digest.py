"""The export-side digest: what the shards held before a gather, against what the gather made.

Shared by the training backends' exports (`megatron/export.py`, `deepspeed/export.py`); the
driver's sync judges the verdict (`xray/sync/export_check.py`). Errors before anything is sent
(a gather that puts shards in the wrong order, takes one from another layer or a stale copy, a
name map that swaps tensors, a data-parallel replica that drifted) are caught here, exactly.

A digest is three integers over the tensor's bit patterns (each element read as a signed integer
of its own width: int32 for fp32, int16 for bf16/fp16), with every piece placed at its
coordinates in the Hugging Face tensor (row, column; a 1-D tensor is one column), all modulo 2**32
(torch's wrapping int32 arithmetic, so the sums run at the speed of a float sum):
- the sum of all bit patterns;
- the sum over rows of mix(row) * (the row's sum), `mix` a fixed integer hash of the position;
- the same over columns.
Sums modulo 2**32 are exact and do not depend on the order of summation, so the digest of a
tensor is the sum of its pieces' digests, with no tolerance: any one changed element changes the
first term, pieces exchanged along rows (or columns) the second (or third), but for a 2**-32
chance. Float sums would need a tolerance that a one-element change can hide under.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

WRAP = 2**32
"""The digest's terms are integers modulo WRAP (held in int64, in [0, WRAP))."""

_GOLDEN = 0x9E3779B1 - 2**32
"""An odd 32-bit multiplier (Knuth's), as a signed int32: `_weighted` hashes a position with it."""

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` as 2-D signed integer words [rows, columns] (a 1-D tensor: [n, 1]) and the words per
    element: an 8-byte dtype is read as two int32 words per element (its columns doubled)."""
    t = t.detach()
    t = t.reshape(-1, 1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
    size = t.element_size()
    if size in _WORDS:
        return t.view(_WORDS[size]), 1
    return t.contiguous().view(torch.int32), size // 4


def _weighted(sums: torch.Tensor, start: int) -> torch.Tensor:
    """sum_i mix(start + i) * sums[i], modulo 2**32 (int32 [n] -> int32 scalar)."""
    index = torch.arange(start + 1, start + 1 + sums.numel(), device=sums.device, dtype=torch.int32)
    mixed = index * _GOLDEN
    mixed ^= mixed >> 15
    return (mixed * sums).sum(dtype=torch.int32)


def digest(t: torch.Tensor, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """int64 [3] of `t` placed at row `row0`, column `col0` of its full tensor (module docstring)."""
    words, per_element = _words(t)
    if words.shape[1] == 1:
        row_sums = words.reshape(-1).to(torch.int32)
    else:
        row_sums = words.sum(1, dtype=torch.int32)
    col_sums = words.sum(0, dtype=torch.int32)
    terms = torch.stack([row_sums.sum(dtype=torch.int32), _weighted(row_sums, row0),
                         _weighted(col_sums, col0 * per_element)])
    return terms.to(torch.int64).cpu() % WRAP


def combine(parts: torch.Tensor) -> torch.Tensor:
    """The digest of a tensor from its pieces' digests, int64 [..., pieces, 3] -> [..., 3]."""
    return parts.sum(-2) % WRAP


@dataclass
class ExportCheck:
    """The verdict of one export's digest check, on the exporting shard."""

    checked: int = 0
    """Exported tensors whose gathered digest equals their shards' (any mismatch also counts)."""
    mismatched: list[str] = field(default_factory=list)
    """Tensors the gather built otherwise than their shards held, each with what differs."""
    diverged: list[str] = field(default_factory=list)
    """Tensors a data-parallel replica holds otherwise than the exporting one, naming the rank."""
    unchecked: list[str] = field(default_factory=list)
    """Exported tensors no digest could be composed for (DeepSpeed's LoRA-merged weights)."""
    replicas: int = 1
    """Data-parallel replicas compared (1: none to compare)."""

    def as_dict(self) -> dict:
        return {"checked": self.checked, "mismatched": list(self.mismatched), "diverged": list(self.diverged),
                "unchecked": list(self.unchecked), "replicas": self.replicas}


def judge(name: str, gathered: torch.Tensor, expected: torch.Tensor, verdict: ExportCheck) -> None:
    """Record in `verdict` the gathered tensor `name` (as it is about to be sent) against
    `expected`, the combined digest of the shards it was made from."""
    got = digest(gathered)
    verdict.checked += 1
    if not torch.equal(got, expected):
        what = ["bit sum", "row term", "column term"]
        differ = [w for w, a, b in zip(what, got.tolist(), expected.tolist()) if a != b]
        verdict.mismatched.append(f"{name}: its digest's {', '.join(differ)} differ from its shards'")
