"""Backends: the libraries that do the work inside one model, loaded lazily by name.

Training backends (`megatron`, `deepspeed`) and generation backends (`vllm`, `dsinfer`) each live
in their own module and meet the contracts of `xray.backends.base`. Which module an engine is, and
the valid `--backend` pairs, are facts of the engine registry (`xray/config/engines.py`). Nothing
here imports them at `import xray` time: `load_backend(name)` imports the module when a Workhorse
first needs it, so `import xray` works on a machine without megatron, deepspeed or vllm.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from xray.config.engines import EngineError, engine, names


class BackendError(ValueError):
    """An unknown backend name, or a backend whose library is not installed."""


def load_backend(name: str) -> ModuleType:
    """Import the module of backend `name` (an engine of the registry with a `module`)."""
    try:
        module = engine(name).module
    except EngineError:
        module = None
    if module is None:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(names(having='module'))}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendError(
            f"backend {name!r} could not be imported ({exc}); install xray's pinned environment "
            "with `make install` (CPU) or `make install XRAY_DEVICE=cuda` (GPU)") from exc
