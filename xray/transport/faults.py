"""Fault injection for testing a weight sync's verification: never set in a run.

`sync_weights(..., corrupt=FAULT)` breaks a sync on purpose, so that a test can show which part
of the verification (`xray/sync/weights.py`) catches it; the sending Workhorse applies it
(`TrainWorkhorse.push_weights`), so it sits with the transports. FAULT is
a tensor name (changed by +1e-2 in transit, its checksum kept: the old form), or `kind:names`:
- in transit, after the checksums were taken (the checksum must catch it, or the manifest):
  `perturb:A` (+1e-2), `swap:A,B` (two same-shape tensors' bytes exchanged: an offset bug between
  layers), `rows:A` (rows 0 and 1 of A exchanged inside the bucket), `transpose:A` (a square A
  sent transposed), `drop:A` (A listed in the manifest, never delivered);
- at export, before the manifest and checksums (only the log-prob comparison can see it, the
  engine holding exactly what it was sent): `rename:A,B` (two same-shape tensors sent under each
  other's names: a wrong name mapping); `unsent:A` (A missing from the export and the manifest).
"""
from __future__ import annotations

import torch

from xray.backends.base import WeightBucket
from xray.transport.wire import unpack_bucket

TRANSIT = ("perturb", "swap", "rows", "transpose", "drop")
EXPORT = ("rename", "unsent")


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
    if kind == "rename" and all(n in dict(bucket) for n in names):
        a, b = names
        return [(b if n == a else a if n == b else n, t) for n, t in bucket]
    return bucket


def in_transit(wire: list, fault: str | None) -> list:
    """The wire form of a bucket (`xray.transport.wire.pack_bucket`) with a transit fault applied,
    each entry keeping the checksum taken before it (unchanged for an export fault or None)."""
    if fault is None:
        return wire
    kind, names = parse(fault)
    if kind not in TRANSIT:
        return wire
    tensors = {e[0]: t for e, (_, t) in zip(wire, unpack_bucket(wire))}
    if not all(n in tensors for n in names):
        return wire
    if kind == "drop":
        return [e for e in wire if e[0] != names[0]]
    changed: dict[str, torch.Tensor] = {}
    a = tensors[names[0]]
    if kind == "perturb":
        changed[names[0]] = (a + 1e-2).to(a.dtype)
    elif kind == "swap":
        changed.update({names[0]: tensors[names[1]], names[1]: a})
    elif kind == "rows":
        changed[names[0]] = a[[1, 0, *range(2, a.shape[0])]]
    elif kind == "transpose":
        changed[names[0]] = a.t()
    out = []
    for entry in wire:
        if entry[0] in changed:
            data = changed[entry[0]].contiguous().reshape(-1).view(torch.uint8).numpy()
            entry = (*entry[:3], data, entry[4])
        out.append(entry)
    return out
