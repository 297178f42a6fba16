"""Which Workhorse class serves a (backend, role) pair: the one table the runtime consults.

Classes are imported only when asked for, so `import xray` never imports a backend library.
"""
from __future__ import annotations

import importlib

_TABLE = {
    "hf": "xray.workhorse.hf:HFWorkhorse",
    "echo": "xray.workhorse.echo:EchoWorkhorse",
    "hf-reward": "xray.workhorse.reward:RewardWorkhorse",
    "fn-reward": "xray.workhorse.function_reward:FunctionRewardWorkhorse",
    "megatron": "xray.workhorse.train:TrainWorkhorse",
    "deepspeed": "xray.workhorse.train:TrainWorkhorse",
    "vllm": "xray.workhorse.rollout:RolloutWorkhorse",
    "dsinfer": "xray.workhorse.rollout:RolloutWorkhorse",
}


class UnknownWorkhorse(ValueError):
    """No Workhorse serves this backend."""


def workhorse_class(backend: str, role: str = "actor") -> type:
    """The Workhorse class for `backend` (roles share a class and branch on their role)."""
    if backend not in _TABLE:
        raise UnknownWorkhorse(f"no Workhorse for backend {backend!r} (role {role!r}); "
                               f"available: {', '.join(sorted(_TABLE))}")
    module, name = _TABLE[backend].split(":")
    return getattr(importlib.import_module(module), name)
