"""xray: distributed reinforcement learning for language models on Ray.

Workhorse (one device's shard, `xray.workhorse`) -> WholeModel (one whole model, `xray.wholemodel`)
-> the verified weight sync (`xray.sync`) -> the run machinery every RL algorithm shares
(`xray.run`) -> algorithms (`algorithms/`: math plus a spec each). Importing xray is cheap: it
starts no Ray cluster and imports no backend library (megatron, deepspeed, vllm); those load when
first used.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "WholeModel": ("xray.wholemodel", "WholeModel"),
    "Batch": ("xray.data.batch", "Batch"),
    "load_config": ("xray.config", "load_config"),
    "sync_to": ("xray.sync", "sync_to"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'xray' has no attribute {name!r}")


__all__ = list(_LAZY)
