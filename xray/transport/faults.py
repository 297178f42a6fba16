"""Fault injection for testing a weight sync's verification: never set in a run.

`sync_weights(..., corrupt=FAULT)` breaks a sync on purpose, so that a test can show which part
of the verification (`xray/sync/weights.py`) catches it; the sending Workhorse applies it
(`TrainWorkhorse.push_weights`), on the wire form (`in_transit`: object store, shared memory) or
in the flat buffer of a device transport (`in_buffer`: CUDA IPC, a process group), so it sits
with the transports. FAULT is a tensor name (changed by +1e-2 in transit, its checksum kept: the
old form), or `kind:names`:
- in transit, after the checksums were taken (the checksum must catch it, or the manifest):
  `perturb:A` (+1e-2), `swap:A,B` (two same-shape tensors' bytes exchanged: an offset bug between
  layers), `rows:A` (rows 0 and 1 of A exchanged inside the bucket), `transpose:A` (a square A
  sent transposed), `drop:A` (A listed in the manifest, never delivered);
- in the metadata sent with the bytes, which no checksum sees (the manifest comparison must):
  `reshape:A` (A's bytes sent flattened, as one row), `retype:A` (A's bytes labelled with another
  dtype of the same width);
- in the checksums' family: `family:F` (every checksum of the bucket named F, its value kept: a
  sender naming another family than the one it computed, or than its transport's);
- at export, before the manifest and checksums (only the log-prob comparison can see it, the
  engine holding exactly what it was sent): `rename:A,B` (two same-shape tensors of one export
  bucket sent under each other's names: a wrong name mapping; a pair split over two buckets
  raises); `unsent:A` (A missing from the export and the manifest).
"""
from __future__ import annotations

import torch

from xray.backends.base import WeightBucket
from xray.transport.wire import FlatLayout, bytes_tensor, tensor_of

TRANSIT = ("perturb", "swap", "rows", "transpose", "drop", "reshape", "retype", "family")
EXPORT = ("rename", "unsent")
SAME_WIDTH = {"float32": "int32", "int32": "float32", "bfloat16": "float16", "float16": "bfloat16",
              "int64": "float64", "float64": "int64"}
"""The dtype `retype` labels a tensor's bytes with (the same width, so the byte count still fits)."""


def parse(fault: str) -> tuple[str, list[str]]:
    """(kind, names) of a fault string; a bare name is `perturb`."""
    kind, sep, names = fault.partition(":")
    if not sep:
        return "perturb", [fault]
    if kind not in TRANSIT + EXPORT:
        raise ValueError(f"fault kind {kind!r}; use one of {', '.join(TRANSIT + EXPORT)}")
    return kind, names.split(",")


def on_export(bucket: WeightBucket, fault: str | None) -> WeightBucket:
    """`bucket` with an export fault applied (unchanged for a transit fault or None)."""
    if fault is None:
        return bucket
    kind, names = parse(fault)
    if kind == "unsent":
        return [(n, t) for n, t in bucket if n != names[0]]
    if kind == "rename":
        present = [n for n in names if n in dict(bucket)]
        if len(present) == 1:  # the pair straddles two buckets: the fault could not be applied
            raise ValueError(f"fault {fault!r}: {present[0]} and its partner are in different export buckets; "
                             "name two tensors of one bucket, or raise the bucket size")
        if present:
            a, b = names
            return [(b if n == a else a if n == b else n, t) for n, t in bucket]
    return bucket


def _changed_values(kind: str, names: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    a = tensors[names[0]]
    if kind == "perturb":
        return {names[0]: (a + 1e-2).to(a.dtype)}
    if kind == "swap":
        return {names[0]: tensors[names[1]].clone(), names[1]: a.clone()}  # copies: in a buffer they are overwritten
    if kind == "rows":
        return {names[0]: a[[1, 0, *range(2, a.shape[0])]]}
    if kind == "transpose":
        return {names[0]: a.t()}
    return {}


def in_transit(wire: list, fault: str | None) -> list:
    """The wire form of a bucket (`xray.transport.wire.pack_bucket`; its bytes as NumPy arrays or
    uint8 tensors) with a transit fault applied, each entry keeping the checksum taken before it
    (unchanged, the same list, for an export fault or None)."""
    if fault is None:
        return wire
    kind, names = parse(fault)
    if kind not in TRANSIT:
        return wire
    if kind == "family":
        return [(*e[:4], None if e[4] is None else (names[0], e[4][1])) for e in wire]
    tensors = {e[0]: tensor_of(e[0], e[3], e[1], e[2]) for e in wire}
    if not all(n in tensors for n in names):
        return wire
    if kind == "drop":
        return [e for e in wire if e[0] != names[0]]
    changed = _changed_values(kind, names, tensors)
    out = []
    for entry in wire:
        name, dtype, shape, data, sent = entry
        if name in changed:
            raw = changed[name].contiguous().reshape(-1).view(torch.uint8)
            entry = (name, dtype, shape, raw if isinstance(data, torch.Tensor) else raw.numpy(), sent)
        elif name == names[0] and kind == "reshape":
            entry = (name, dtype, (1, int(tensors[name].numel())), data, sent)
        elif name == names[0] and kind == "retype":
            entry = (name, SAME_WIDTH.get(dtype, dtype), shape, data, sent)
        out.append(entry)
    return out


def in_buffer(buffer: torch.Tensor, layout: FlatLayout, fault: str | None) -> FlatLayout:
    """A bucket's flat form (`xray.transport.wire.pack_into`) with a transit fault applied: the
    bytes changed in `buffer` in place, the layout returned changed (metadata, a tensor dropped);
    each entry keeps the checksum taken before."""
    if fault is None:
        return layout
    entries = [(name, dtype, shape, buffer[start:start + nbytes], sent)
               for name, dtype, shape, start, nbytes, sent in layout]
    faulty = in_transit(entries, fault)
    if faulty is entries:
        return layout
    by_name = {e[0]: e for e in faulty}
    out = []
    for (name, _, _, start, nbytes, _), (_, _, _, piece, _) in zip(layout, entries):
        if name not in by_name:
            continue
        _, dtype, shape, data, sent = by_name[name]
        if data is not piece:
            piece.copy_(bytes_tensor(data).to(piece.device))
        out.append((name, dtype, shape, start, nbytes, sent))
    return out
