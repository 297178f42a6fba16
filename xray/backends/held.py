"""The exact half of a weight sync's verification: does the engine hold what it was sent?

Used by the generation engines (`vllm_held.py` for vLLM, `dsinfer.py`) right after they load a
bucket, and reported by the rollout Workhorse at the end of a sync (`xray/sync/weights.py` judges
it), with the name of every tensor given a verdict; the engine separately names the tensors its
loads wrote (`GenerationEngine.held_tensors`), and the two must match (`xray/sync/coverage.py`).
Each engine tensor is checked one of two ways, and none may be left unchecked:
- exact (`compare`): read back and compared bit for bit with the tensors it was sent, laid out as
  the engine lays them out (vLLM's fused q/k/v and gate/up, its vocabulary padding, a
  tensor-parallel shard) and cast to the engine's dtype the way its own load casts them (round to
  nearest). In bf16 this is the only tight check there is: two bf16 implementations of one model
  differ in their log-probs by as much as bf16 differs from fp32 (FACTS.md);
- functional (`compare_product`), where the engine keeps no readable copy (vLLM on CPU repacks
  every linear layer's weight for oneDNN and drops the plain tensor): the engine's own layer
  applied to a seeded random input, against the same product computed in fp32 from the tensor
  received, within `product_bound`, a bound derived from the engine's dtype and the layer's width
  (the rounding of the output plus the accumulation error of two K-term dot products, the
  engine's and ours), and in the same call a few seeded columns of the weight read back exactly
  through the kernel (an input row that is a column's unit vector gives that column with no
  rounding): the bound is too wide to see a weight one optimizer step stale at a real width
  (~2e-2 against a ~5e-4 move at width 2048), the columns are not. One pass over the weight, no
  copy of it in fp32: about as cheap as reading it back.

A quantized engine (`rollout.quantization`) holds its linear layers as fp8 codes and scales:
`compare_fp8` checks them against our own quantization of the tensors sent
(`xray/backends/quantize.py`), code for code and scale for scale; a difference is a mismatch
named with how much differs.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from xray.backends.quantize import FP8, fp8_difference, fp8_per_channel

PROBE_ROWS = 4
"""Rows of the seeded random input of a functional check."""
BASIS_ROWS = 8
"""Columns of a weight a functional check reads back exactly through the engine's own kernel."""
ACCUMULATION_EPS = 2.0 ** -24
"""Unit roundoff of the accumulation of a matrix product (fp32 for fp32, bf16 and fp16 engines:
oneDNN and cuBLAS accumulate bf16 products in fp32)."""
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                 FP8: 2.0 ** -4}
"""Unit roundoff of each dtype an engine may hold or output."""
SLACK = 2.0
"""Safety factor on the worst-case bound."""


@dataclass
class HeldCheck:
    """Counts of an engine's tensors checked against what it was sent since the last `take`, and
    the name of every tensor a verdict was given on (`checked`): the driver compares those with
    the tensors the engine's loads wrote (`GenerationEngine.held_tensors`), so that no tensor
    counts as checked that was not, and none escapes the check (`xray/sync/coverage.py`)."""

    exact: int = 0
    """Engine tensors found equal, bit for bit, to the expected values."""
    functional: int = 0
    """Engine layers whose product with a seeded input matched the received tensor's within bound."""
    unchecked: int = 0
    """Engine tensors neither read back nor checked functionally (fails the sync)."""
    mismatched: list[str] = field(default_factory=list)
    """Engine tensors that differ from what was sent, each with how."""
    checked: list[str] = field(default_factory=list)
    """The engine tensors given a verdict (exact, functional, unchecked or mismatched), in order."""

    def passed(self, kind: str, names: list[str]) -> None:
        """`names` were found to hold what was sent: `kind` "exact" (read back) or "functional"."""
        setattr(self, kind, getattr(self, kind) + len(names))
        self.checked += names

    def skip(self, names: list[str]) -> None:
        """`names` could be neither read back nor checked functionally (the sync fails)."""
        self.unchecked += len(names)
        self.checked += names

    def mismatch(self, what: str, names: list[str]) -> None:
        """`names` hold otherwise than sent (`what` says how; the sync fails)."""
        self.mismatched.append(what)
        self.checked += names

    def compare(self, name: str, held: torch.Tensor | None, expected: torch.Tensor) -> bool:
        """Compare the engine's tensor `name` with `expected` (the sent values, laid out as held).
        False when it cannot be read (the caller may then check it functionally)."""
        same = held_equals(held, expected)
        if same is None:
            return False
        if same:
            self.passed("exact", [name])
        else:
            self.mismatch(f"{name} [held otherwise than sent]", [name])
        return True

    def compare_product(self, name: str, apply, width: int, expected: torch.Tensor | list[torch.Tensor],
                        dtype: torch.dtype, held_dtype: torch.dtype | None = None) -> None:
        """The functional check of layer `name`: `apply(x)` (the engine's own layer, no bias, on
        an input of `width` columns) against x @ expected.T, `expected` being the received weight
        laid out as the layer holds it `[N, width]` (or its row blocks in order, a fused layer's
        parts: never concatenated), cast to the engine's `dtype` (`held_dtype`: what the layer
        keeps its weight in, fp8 for a quantized layer). One call on two kinds of rows: seeded
        random rows, within `product_bound` of our fp32 product (every column of the weight
        counts), and `BASIS_ROWS` rows that are each one seeded column's unit vector, whose
        product is that column of the weight exactly (a sum of one product and exact zeros: no
        rounding), so those columns are read back bit for bit through the engine's own kernel: a
        weight one optimizer step stale, or rows swapped, differs there where the random rows'
        bound is too wide to see it (a fp8 layer holds its codes x scale: its basis rows are held
        to the bound)."""
        blocks = expected if isinstance(expected, list) else [expected]
        if any(w.dim() != 2 or w.shape[1] != width for w in blocks):
            self.skip([name])
            return
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        columns = torch.randperm(width, generator=g)[:min(BASIS_ROWS, width)]
        x32 = torch.cat([torch.randn(PROBE_ROWS, width, generator=g),
                         torch.nn.functional.one_hot(columns, width).float()])
        got = apply(x32.to(dtype))
        x32 = x32.to(dtype).float()
        wants, norms, read = [], [], []
        for w in blocks:
            w = w.to(dtype).cpu()
            read.append(w[:, columns].t())
            w = w if w.dtype == torch.float32 else w.float()
            wants.append(x32 @ w.t())
            norms.append(torch.linalg.vector_norm(w, dim=1))
        want = wants[0] if len(wants) == 1 else torch.cat(wants, dim=1)
        if tuple(got.shape) != tuple(want.shape):
            self.mismatch(f"{name} [its product has shape {tuple(got.shape)}, expected {tuple(want.shape)}]", [name])
            return
        got = got.detach().cpu()
        exact = held_dtype != FP8
        if exact and not torch.equal(got[PROBE_ROWS:].float(), torch.cat(read, dim=1).float()):
            differ = got[PROBE_ROWS:].float() != torch.cat(read, dim=1).float()
            row, col = (int(i) for i in differ.nonzero()[0])
            self.mismatch(f"{name} [column {int(columns[row])} read back through its kernel differs from what was "
                          f"sent in {int(differ.sum())} of {differ.numel()} values (first: output row {col}): held "
                          "otherwise than sent]", [name])
            return
        rows = slice(0, PROBE_ROWS) if exact else slice(None)
        # sum_k |x_k w_jk| <= |x| |w_j| (Cauchy-Schwarz): the row norms, no |w| copy
        scale = torch.linalg.vector_norm(x32[rows], dim=1)[:, None] * torch.cat(norms)[None, :]
        bound = product_bound(want[rows].double(), scale.double(), 2 * width, dtype, held_dtype or dtype)
        err = (got[rows].double() - want[rows].double()).abs()
        if bool((err <= bound).all()):
            self.passed("functional", [name])
        else:
            worst = int((err - bound).argmax())
            self.mismatch(f"{name} [product off by {float(err.view(-1)[worst]):.3g}, bound "
                          f"{float(bound.view(-1)[worst]):.3g}: held otherwise than sent]", [name])

    def compare_fp8(self, name: str, held: torch.Tensor | None, held_scale: torch.Tensor | None,
                    expected: torch.Tensor, dtype: torch.dtype) -> bool:
        """Compare the engine's per-channel fp8 layer `name` (codes `held` laid out `[K, N]`, as vLLM
        keeps them, and `held_scale` `[N, 1]`) with the reference quantization of `expected`
        `[N, K]` (the sent values, fused parts concatenated) cast to the engine's `dtype`. False
        when the layer is laid out otherwise (a tensor-parallel shard, a repacked kernel)."""
        if held is None or held_scale is None or held.dim() != 2 or \
                tuple(held.shape) != tuple(expected.shape[::-1]) or held_scale.numel() != expected.shape[0]:
            return False
        codes, scale = fp8_per_channel(expected, dtype)
        diff = fp8_difference(codes, scale, held.detach().cpu().t(), held_scale.detach().cpu())
        if diff is None:
            self.passed("exact", [name])
        else:
            self.mismatch(f"{name} [{diff}]", [name])
        return True

    def merge(self, counts: dict) -> None:
        """Add the counts another check took (`take`), e.g. one run inside the engine's model."""
        self.exact += counts["exact"]
        self.functional += counts["functional"]
        self.unchecked += counts["unchecked"]
        self.mismatched += counts["mismatched"]
        self.checked += counts["checked"]

    def take(self) -> dict:
        """The counts so far as a dict, with the names checked (reset afterwards)."""
        out = {"exact": self.exact, "functional": self.functional, "unchecked": self.unchecked,
               "mismatched": list(self.mismatched), "checked": list(self.checked)}
        self.exact, self.functional, self.unchecked, self.mismatched, self.checked = 0, 0, 0, [], []
        return out


def product_bound(want: torch.Tensor, scale: torch.Tensor, width: int, dtype: torch.dtype,
                  held_dtype: torch.dtype) -> torch.Tensor:
    """How far an engine's `[rows, N]` product may lie from our fp32 one `want` when both hold the
    right weights: its output rounded to `dtype` (u |y|) plus the accumulation error of the dot
    products in fp32 (`width` terms in all, x 2^-24 x `scale`, a bound of sum |x||w|), times
    `SLACK`; a layer kept in fp8 adds the rounding of its weights and of its input to fp8
    (2 x 2^-4 x `scale`)."""
    u_out = UNIT_ROUNDOFF.get(dtype, 2.0 ** -8)
    terms = u_out * want.abs() + width * ACCUMULATION_EPS * scale
    if held_dtype == FP8:
        terms = terms + 2 * UNIT_ROUNDOFF[FP8] * scale
    return SLACK * terms + 1e-30


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
