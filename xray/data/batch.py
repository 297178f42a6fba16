"""Batch: the one data type that crosses a Ray call between the algorithm and its WholeModels.

Named tensor columns share a leading dimension (the batch size `B`); non-tensor columns are lists
of length `B` (prompt text, reference answers...); `meta` holds values about the whole batch
(the weight version that produced it, say). The fan-out protocol splits a Batch over
data-parallel replicas with `split` and joins answers back with `Batch.concat`.

Across processes a Batch travels in the wire form of `xray.data.wire`: tensor columns out of band
(zero-copy reads from Ray's object store), token-id lists as flat arrays plus offsets.

Why not `tensordict`: its releases track torch releases closely, and our pins already fix torch to
the build vLLM wants; the few operations we need fit here, pickle cleanly for Ray, and keep
non-tensor columns first-class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from xray.data import wire

class BatchError(ValueError):
    """A batch whose columns disagree, or an operation it cannot support; says how to fix it."""


@dataclass
class Batch:
    """Columns with a shared leading dimension, plus batch-wide metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensor columns, each `[B, ...]`."""
    lists: dict[str, list] = field(default_factory=dict)
    """Non-tensor columns, each a list of length `B`."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Values about the whole batch; kept by split and select, merged (first wins) by concat."""

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items() if v.dim() > 0}
        sizes.update({k: len(v) for k, v in self.lists.items()})
        for k, v in self.tensors.items():
            if v.dim() == 0:
                raise BatchError(f"column {k!r} is a 0-d tensor; put batch-wide values in meta")
        if len(set(sizes.values())) > 1:
            raise BatchError(f"columns have different leading sizes: {sizes}; "
                             "every column must have one row per sample")
        overlap = set(self.tensors) & set(self.lists)
        if overlap:
            raise BatchError(f"column names used twice: {sorted(overlap)}")

    @classmethod
    def from_columns(cls, columns: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> "Batch":
        """Build from a mapping whose tensor values become tensor columns and the rest list columns."""
        tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
        lists = {k: list(v) for k, v in columns.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, lists, dict(meta or {}))

    def __reduce__(self):
        return (_rebuild, wire.encode(self.tensors, self.lists, self.meta))

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.lists.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.lists

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.lists:
            return self.lists[key]
        raise KeyError(f"no column {key!r}; columns are {self.keys()}")

    def __setitem__(self, key: str, value) -> None:
        n = len(self) if self.keys() else None
        if isinstance(value, torch.Tensor):
            size = value.shape[0] if value.dim() else None
            self.lists.pop(key, None)
            target = self.tensors
        else:
            value = list(value)
            size = len(value)
            self.tensors.pop(key, None)
            target = self.lists
        if size is None or (n is not None and size != n and self.keys() != [key]):
            raise BatchError(f"column {key!r} has {size} rows, the batch has {n}")
        target[key] = value

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.lists)

    def select(self, keys: Iterable[str]) -> "Batch":
        """A batch with only these columns (sharing storage)."""
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"no columns {missing}; columns are {self.keys()}")
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.lists[k] for k in keys if k in self.lists}, dict(self.meta))

    def index(self, idx: slice | Sequence[int] | torch.Tensor) -> "Batch":
        """Rows `idx` of every column (a slice shares storage; an index list copies)."""
        if isinstance(idx, slice):
            return Batch({k: v[idx] for k, v in self.tensors.items()},
                         {k: v[idx] for k, v in self.lists.items()}, dict(self.meta))
        rows = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        t = torch.as_tensor(rows, dtype=torch.long)
        return Batch({k: v.index_select(0, t.to(v.device)) for k, v in self.tensors.items()},
                     {k: [v[i] for i in rows] for k, v in self.lists.items()}, dict(self.meta))

    def split(self, parts: int) -> list["Batch"]:
        """Split into `parts` equal consecutive batches; raise if the rows do not divide evenly."""
        n = len(self)
        if parts < 1:
            raise BatchError(f"cannot split into {parts} parts")
        if n % parts:
            raise BatchError(
                f"a batch of {n} rows does not split evenly into {parts} parts; "
                f"use a batch size that is a multiple of {parts} (for example {parts * max(1, n // parts)})")
        step = n // parts
        return [self.index(slice(i * step, (i + 1) * step)) for i in range(parts)]

    def chunks(self, size: int) -> list["Batch"]:
        """Consecutive batches of `size` rows; raise if `size` does not divide the batch."""
        n = len(self)
        if size < 1 or n % size:
            raise BatchError(f"micro-batch size {size} does not divide the batch of {n} rows; "
                             "choose a micro-batch size that divides the batch size")
        return self.split(n // size)

    def micro_batches(self, at_most: int | None) -> list["Batch"]:
        """Equal consecutive batches of the largest size that divides the batch and is at most
        `at_most` rows (the whole batch when None): a forward's micro-batches."""
        n = len(self)
        if at_most is None or at_most >= n:
            return [self]
        return self.chunks(max(d for d in range(1, max(1, at_most) + 1) if n % d == 0))

    @staticmethod
    def concat(batches: Sequence["Batch"], pad_width: bool = False) -> "Batch":
        """Join batches row-wise; they must have the same columns. With `pad_width`, tensor
        columns of 2+ dimensions whose widths (dim 1) differ are right-padded with zeros to the
        widest: parts of one batch packed separately (their padding is masked by ATTENTION_MASK
        and LOSS_MASK, so the pad value never reaches a result)."""
        batches = [b for b in batches if b is not None]
        if not batches:
            return Batch()
        keys = batches[0].keys()
        for i, b in enumerate(batches[1:], 1):
            if sorted(b.keys()) != sorted(keys):
                raise BatchError(f"batch {i} has columns {sorted(b.keys())}, batch 0 has {sorted(keys)}")
        tensors = {k: torch.cat(_widened([b.tensors[k] for b in batches], pad_width)) for k in batches[0].tensors}
        lists = {k: _joined([b.lists[k] for b in batches]) for k in batches[0].lists}
        meta: dict[str, Any] = {}
        for b in batches:
            for k, v in b.meta.items():
                meta.setdefault(k, v)
        return Batch(tensors, lists, meta)

    def to(self, device: str | torch.device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.lists), dict(self.meta))

    def nbytes(self) -> int:
        return sum(v.element_size() * v.nelement() for v in self.tensors.values())

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                         for k, v in self.tensors.items())
        lists = ", ".join(f"{k}: list" for k in self.lists)
        return f"Batch(n={len(self)}; {cols}{'; ' if lists else ''}{lists})"


def _joined(columns: list) -> Any:
    """List columns one after another (ragged columns stay ragged)."""
    if all(isinstance(c, wire.Ragged) for c in columns):
        return wire.Ragged.concat(columns)
    return [x for c in columns for x in c]


def _widened(columns: list[torch.Tensor], pad: bool) -> list[torch.Tensor]:
    """The columns right-padded along dim 1 to the widest (when `pad` and they differ)."""
    widths = {c.shape[1] for c in columns if c.dim() >= 2}
    if not pad or len(widths) < 2:
        return columns
    width = max(widths)
    return [torch.nn.functional.pad(c, (0, 0) * (c.dim() - 2) + (0, width - c.shape[1])) for c in columns]


def _rebuild(tensors: dict, lists: dict, meta: dict) -> Batch:
    return Batch(*wire.decode(tensors, lists, meta))
