"""Workhorse: one device's shard of one model (a Ray actor in production, a plain class in tests).

`base` (the life cycle every Workhorse shares), `echo` (no model: cluster and protocol checks),
and the role Workhorses built on backend engines. `Workhorse` is imported on first use: the
package's light modules (`drain`, `quiet`) serve processes that hold no model (the run's drain
inbox, the snapshot holders), which then start without importing torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Workhorse"]


def __getattr__(name: str) -> Any:
    if name == "Workhorse":
        from xray.workhorse.base import Workhorse

        return Workhorse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
