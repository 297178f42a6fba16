"""Megatron-core on CPU: the few CUDA assumptions it makes, met on CPU only.

Sits beside the backends in `xray/backends/`; only the Megatron engine uses it, and only when its
device is CPU. The GPU code paths stay Megatron's own. What it adapts (see FACTS.md, "Megatron-core
on CPU"):

1. `TransformerConfig(use_cpu_initialization=True)`: set by the engine, not here.
2. An explicit causal attention mask: the engine always passes one (it also carries the padding).
3. The model-parallel RNG tracker: `apply()` installs Megatron's own tracker whose `fork()` is a
   no-op (the real one saves and restores CUDA RNG state); dropout must be 0.
4. Tensor factories called with `device="cuda"` or `device=torch.cuda.current_device()` (pipeline
   schedules, p2p communication, a few layers): `on_cpu()` is a TorchFunctionMode that rewrites
   those to CPU while Megatron code runs, and `apply()` makes `torch.cuda.current_device()` and
   `torch.cuda.synchronize()` harmless.
5. Megatron's mixed-precision optimizer accepts only parameters whose `.type()` names a CUDA
   tensor: inside `on_cpu()`, a CPU tensor's `.type()` reads as its `torch.cuda.*` name.
6. Megatron's activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA RNG
   state around each recomputed layer: `apply()` makes that state empty (the CPU RNG state, which
   it keeps too, is the one a CPU layer draws from; dropout is 0 anyway).

Usage: call `apply()` once (idempotent) after `parallel_state.initialize_model_parallel`, and wrap
every call into Megatron (build, forward, train step) in `with on_cpu(): ...`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_APPLIED = False
_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    """True for the ways Megatron names a CUDA device: "cuda", "cuda:N", an int index, a torch.device."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to CPU (and `Tensor.cuda()` to a no-op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # Megatron's optimizer checks
            name = func(*args)                                          # for `torch.cuda.*Tensor`
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _current_device() -> int:
    return 0


def _synchronize(device: Any = None) -> None:
    return None


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def apply() -> None:
    """Install the process-wide CPU adaptations (idempotent). Call only when the device is CPU."""
    global _APPLIED
    if _APPLIED:
        return
    if torch.cuda.is_available():
        logger.warning("cpu_compat.apply() called on a machine with CUDA; the engine runs on CPU")
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    # Megatron's own tracker variant whose fork() does not touch CUDA RNG state.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    mp_random._get_cuda_rng_state = _no_cuda_rng_state  # read by the activation recompute (6.)
    mp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    _APPLIED = True
    logger.debug("Megatron-core CPU adaptations applied")


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """While open, torch calls that ask for a CUDA device get the CPU instead."""
    with _CudaToCpu():
        yield


def device_context(device: str) -> contextlib.AbstractContextManager:
    """`on_cpu()` when `device` is the CPU, else a no-op context (the GPU path stays Megatron's)."""
    if torch.device(device).type == "cpu":
        return on_cpu()
    return contextlib.nullcontext()
