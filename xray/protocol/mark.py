"""The mark of a Workhorse method callable through its WholeModel: `@fanout(dispatch=...,
execute=..., collect=..., deadline_s=..., reads=...)` attaches a `FanOut` to the method and does
nothing else, so the Workhorse stays a plain class; and `DispatchError`, what the protocol raises
for arguments it cannot dispatch. The lowest part of the fan-out protocol (`xray/protocol`):
`scatter` and `gather` read these marks' modes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

Dispatch = Union[str, Callable]
Collect = Union[str, Callable]
Reads = Union[None, tuple, Callable]
ATTR = "_xray_fanout"


class DispatchError(ValueError):
    """Arguments that cannot be dispatched as asked; the message says how to fix them."""


@dataclass(frozen=True)
class FanOut:
    """The metadata `@fanout` attaches to a Workhorse method."""

    dispatch: Dispatch = "all"
    execute: str = "all"
    collect: Collect = "none"
    deadline_s: float = 600.0
    """Default deadline of a call; a call may pass its own."""
    reads: Reads = None
    """Batch columns the method reads; only those are shipped (None: all)."""

    def columns(self, args: tuple, kwargs: dict) -> tuple[str, ...] | None:
        """The columns to ship for this call's Batch arguments (None: all)."""
        if callable(self.reads):
            found = self.reads(args, kwargs)
            return None if found is None else tuple(found)
        return self.reads


def fanout(dispatch: Dispatch = "all", execute: str = "all", collect: Collect = "none",
           deadline_s: float = 600.0, reads: Reads = None) -> Callable:
    """Mark a Workhorse method as callable through its WholeModel."""
    if isinstance(dispatch, str) and dispatch not in ("all", "slice"):
        raise ValueError(f"dispatch must be 'all', 'slice' or a callable, got {dispatch!r}")
    if execute not in ("all", "first"):
        raise ValueError(f"execute must be 'all' or 'first', got {execute!r}")
    if isinstance(collect, str) and collect not in ("none", "flatten"):
        raise ValueError(f"collect must be 'none', 'flatten' or a callable, got {collect!r}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, ATTR, FanOut(dispatch, execute, collect, deadline_s, reads))
        return fn

    return mark


def fanout_methods(cls: type) -> dict[str, FanOut]:
    """The marked methods of a Workhorse class, by name."""
    out = {}
    for name in dir(cls):
        meta = getattr(getattr(cls, name, None), ATTR, None)
        if isinstance(meta, FanOut):
            out[name] = meta
    return out
