"""How a Batch crosses a process boundary: tensors out of band, token-id lists as flat arrays.

`Batch.__reduce__` calls `encode`, and unpickling calls `decode`. Under pickle protocol 5 (what
Ray uses) NumPy arrays travel out of band: Ray copies their bytes once into the object store,
and a reader on the same node maps them without a copy. So:

- every tensor column goes as a flat `uint8` NumPy view of its bytes, plus its dtype and shape
  (any torch dtype, bf16 included; no copy for a contiguous CPU tensor). On the way back, columns
  under `COPY_BELOW` bytes are copied into private memory; larger ones stay read-only views of the
  object store: clone one before writing into it;
- a list column whose rows are lists of numbers (token ids, per-token log-probs) goes as one flat
  array and an offsets array, and comes back as a `Ragged` column: a read-only sequence of
  lists that builds each row only when asked, so a Workhorse that never reads the column pays
  nothing for it;
- other list columns (text, dicts) and `meta` are pickled as they are.
"""
from __future__ import annotations

import warnings
from itertools import chain
from typing import Any, Iterator, Sequence

import numpy as np
import torch

COPY_BELOW = 256 << 10
"""Tensor columns smaller than this are copied on arrival (cheap, and writable)."""

# A tensor on the wire: (torch dtype name, shape, its bytes as a flat uint8 array).
WireTensor = tuple[str, tuple[int, ...], np.ndarray]


class Ragged(Sequence):
    """A list column of number lists, stored as one flat array and row offsets (`[B + 1]`)."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence]) -> "Ragged | None":
        """The ragged form of `rows`, or None when they are not all lists of numbers."""
        if not all(isinstance(r, (list, tuple)) for r in rows):
            return None
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        flat = np.array(list(chain.from_iterable(rows)))
        if flat.size and flat.dtype.kind not in "iufb":
            return None
        if not flat.size:
            flat = np.zeros(0, dtype=np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum(lengths)]))

    @classmethod
    def concat(cls, columns: Sequence["Ragged"]) -> "Ragged":
        """The rows of `columns` one after another."""
        flats = [c.flat[c.offsets[0]:c.offsets[-1]] for c in columns]
        starts = np.cumsum([0] + [len(f) for f in flats])
        offsets = [c.offsets[:-1] - c.offsets[0] + s for c, s in zip(columns, starts)]
        return cls(np.concatenate(flats), np.concatenate(offsets + [starts[-1:]]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:  # a view: rows start..stop-1 share this column's storage
                return Ragged(self.flat, self.offsets[start:max(start, stop) + 1])
            return [self[j] for j in range(start, stop, step)]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} of a column of {n} rows")
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()

    def __iter__(self) -> Iterator[list]:
        flat, offsets = self.flat.tolist(), self.offsets.tolist()
        for a, b in zip(offsets, offsets[1:]):
            yield flat[a:b]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, {self.flat.size} values, {self.flat.dtype})"


def pack_tensor(tensor: torch.Tensor) -> WireTensor:
    """A byte view of `tensor` (copied only if it is not a contiguous CPU tensor)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy()


def unpack_tensor(wire: WireTensor, copy: bool | None = None) -> torch.Tensor:
    """The tensor viewing the wire's bytes; copied when `copy` (default: when small)."""
    dtype, shape, data = wire
    if copy is None:
        copy = data.nbytes < COPY_BELOW
    if copy or data.flags.writeable:
        data = np.array(data, copy=copy)
        return torch.from_numpy(data).view(getattr(torch, dtype)).view(shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data).view(getattr(torch, dtype)).view(shape)


def _encode_list(values: Any) -> tuple[str, Any]:
    if isinstance(values, Ragged):
        lo, hi = int(values.offsets[0]), int(values.offsets[-1])
        return "ragged", (values.flat[lo:hi], values.offsets - lo)
    ragged = Ragged.from_lists(values) if values else None
    if ragged is not None:
        return "ragged", (ragged.flat, ragged.offsets)
    return "list", list(values)


def _decode_list(kind: str, payload: Any) -> Any:
    return Ragged(*payload) if kind == "ragged" else payload


def encode(tensors: dict[str, torch.Tensor], lists: dict[str, Any], meta: dict) -> tuple:
    """The picklable, out-of-band form of a Batch's parts."""
    return ({k: pack_tensor(v) for k, v in tensors.items()},
            {k: _encode_list(v) for k, v in lists.items()}, meta)


def decode(tensors: dict, lists: dict, meta: dict) -> tuple[dict, dict, dict]:
    """Inverse of `encode`: (tensors, lists, meta) for the Batch constructor."""
    return ({k: unpack_tensor(v) for k, v in tensors.items()},
            {k: _decode_list(*v) for k, v in lists.items()}, meta)
