"""Backends: the libraries that do the work inside one model, loaded lazily by name.

Training backends (`megatron`, `deepspeed`) and generation backends (`vllm`, `dsinfer`) each live
in their own module and meet the contracts of `xray.backends.base`. Nothing here imports them at
`import xray` time: `load_backend(name)` imports the module when a Workhorse first needs it, so
`import xray` works on a machine without megatron, deepspeed or vllm.
"""
from __future__ import annotations

import importlib
from types import ModuleType

TRAIN_BACKENDS = {
    "megatron": "xray.backends.megatron",
    "deepspeed": "xray.backends.deepspeed",
}
GENERATION_BACKENDS = {
    "vllm": "xray.backends.vllm",
    "dsinfer": "xray.backends.dsinfer",
}
# The pairs `--backend` accepts: TRAIN-GENERATION.
BACKEND_PAIRS = ("megatron-vllm", "deepspeed-dsinfer", "megatron-dsinfer", "deepspeed-vllm")


class BackendError(ValueError):
    """An unknown backend name, or a backend whose library is not installed."""


def load_backend(name: str) -> ModuleType:
    """Import the module of backend `name` (a key of TRAIN_BACKENDS or GENERATION_BACKENDS)."""
    table = {**TRAIN_BACKENDS, **GENERATION_BACKENDS}
    if name not in table:
        raise BackendError(f"unknown backend {name!r}; choose one of {sorted(table)}")
    try:
        return importlib.import_module(table[name])
    except ImportError as exc:
        raise BackendError(
            f"backend {name!r} could not be imported ({exc}); install xray's pinned environment "
            "with `make install` (CPU) or `make install XRAY_DEVICE=cuda` (GPU)") from exc


def split_pair(pair: str) -> tuple[str, str]:
    """`megatron-vllm` -> ("megatron", "vllm"), with an error that lists the valid pairs."""
    if pair not in BACKEND_PAIRS:
        raise BackendError(f"unknown --backend {pair!r}; choose one of {', '.join(BACKEND_PAIRS)}")
    train, gen = pair.split("-")
    return train, gen
