"""Which Workhorse class serves a backend: the registry's `workhorse` fact, imported by name.

Each engine's row in `xray/config/engines.py` names its Workhorse class as `module:Class`; the
class is imported only when asked for, so `import xray` never imports a backend library.
"""
from __future__ import annotations

import importlib

from xray.config.engines import ENGINES, EngineError, engine


class UnknownWorkhorse(ValueError):
    """No Workhorse serves this backend."""


def workhorse_class(backend: str, role: str = "actor") -> type:
    """The Workhorse class for `backend` (roles share a class and branch on their role)."""
    try:
        path = engine(backend).workhorse
    except EngineError:
        raise UnknownWorkhorse(f"no Workhorse for backend {backend!r} (role {role!r}); "
                               f"available: {', '.join(sorted(e.name for e in ENGINES))}") from None
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
