"""What building an in-process vLLM engine does to the process it runs in, and how the rollout
backend (`xray/backends/vllm.py`, whose `VllmEngine` builds inside both) keeps it in check: the
caller's random states and `torch.set_num_threads` given back, and on CPU one garbage collection
instead of the five vLLM runs to measure device memory.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def caller_state_kept() -> Iterator[None]:
    """Undo what building a vLLM engine does to the process it runs in: it seeds Python's,
    NumPy's and torch's global RNGs, and its CPU worker replaces `torch.set_num_threads` with a
    no-op (meant for its own pinned worker processes, not for a shared one)."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        torch.set_num_threads = set_num_threads


@contextlib.contextmanager
def one_collection(device: str) -> Iterator[None]:
    """On CPU, one full garbage collection for building the engine instead of vLLM's five (it
    measures device memory around loading the model, and collects before freezing its heap:
    together about 1.3 s of a 7.6 s build of the tiny model on 2 cores, more in a process holding
    more objects); its CPU KV cache is sized by `kv_cache_gib`, not by a measurement. The
    heap ends as vLLM leaves it, frozen, with the build's garbage collected first. On CUDA,
    vLLM's own."""
    import gc

    collect = gc.collect
    if device == "cpu":
        gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect
        if device == "cpu" and gc.get_freeze_count():
            gc.unfreeze()
            gc.collect()
            gc.freeze()
