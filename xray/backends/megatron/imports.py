"""Importing megatron-core for the engine: fast, and ahead of a build.

Sits under `engine.py` in `xray.backends.megatron`, which imports megatron-core only through
`import_megatron` (deferred `torch.compile`); `preload` is a standby Workhorse's warm-up.
"""
from __future__ import annotations

import torch


def import_megatron() -> None:
    """Import megatron-core with `torch.compile` deferred to each decorated function's first call.
    Megatron decorates dozens of fusions with `torch.compile` as its modules import, and each
    decoration sets up TorchDynamo and Inductor: about 1.4 s of every Workhorse's start (2.5 ->
    1.1 s for the import on this machine). The engine's config turns those fusions off, so none
    is ever compiled; one that is called still compiles, at its first call. Weights & Biases,
    which megatron-core imports where it is installed (for its inference engine's and timers'
    logging, which xray does not use: the driver logs), is hidden from this import (~0.5 s of it,
    measured); a later `import wandb` in the process (a user's reward function) imports it."""
    import functools
    import importlib
    import sys

    if "megatron.core" in sys.modules:
        return
    compile_now = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)
        return first_call

    torch.compile = deferred
    hidden = sys.modules.setdefault("wandb", None) is None  # megatron's `import wandb` then fails, as if absent
    try:
        importlib.import_module("megatron.core.models.gpt")  # the package and its fusions
    finally:
        torch.compile = compile_now
        if hidden:
            del sys.modules["wandb"]


def preload() -> None:
    """Import what a build needs (megatron-core, transformers' config and safetensors reading)
    ahead of it: a standby Workhorse's warm-up (`xray/wholemodel/standby.py`)."""
    import_megatron()
    import transformers  # noqa: F401 - the HF directory's config and tokenizer readers
