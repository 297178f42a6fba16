"""Give the host heap's free pages back to the operating system after a Workhorse's big calls.

A training step on the CPU allocates its activations (gigabytes for a real model: SmolLM2-135M in
fp32 saves 2.6 GB for a micro-batch of 4 rows of 400 tokens) and frees them at its end, but glibc's
allocator keeps most of what it freed: once a large block is freed its threshold for handing
blocks to `mmap` rises, later activations land in the heap's arenas, and free arena pages stay
in the process. The process then holds its peak, not its live state, between steps (measured on
that model's actor: 5.8-7.2 GB held after each step against 2.5 GB live), and the node's other
processes (the critic's step, vLLM, the reference) cannot have it: on a 24 GB machine Ray's
memory monitor killed the run. `give_back` asks glibc to return every free page (`malloc_trim`,
~0.3 s after such a step, 1% of it; next to nothing where little was freed, as on a GPU). Used
by `TrainWorkhorse` after each forward and train step; without glibc (macOS, musl) it does nothing.

The Python heap: `freeze_imports` moves what a Workhorse's imports created (torch, Megatron or
DeepSpeed, transformers: ~0.6 M objects) out of the garbage collector's reach before its first
shard is built, so a full collection scans the shard's objects alone. A survivor's `teardown`
collects once to free its engine; without the freeze that collection took ~0.3 s alone and 5-7 s in
each of three survivors sharing one core (an elastic shrink, `benchmarks/fault_injection.py`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys


@functools.lru_cache(maxsize=1)
def _trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries lack it
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def give_back() -> bool:
    """Return the heap's free pages to the operating system; whether the C library could."""
    trim = _trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_anon_bytes() -> int | None:
    """This process's anonymous resident memory (its heap and private mappings; not shared memory
    or mapped files), from /proc; None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def freeze_imports() -> None:
    """Once per process: collect, then freeze every object alive now (the imported libraries), so
    later collections skip them. Call it before building a shard, whose objects must stay
    collectable (`TrainWorkhorse.teardown` frees an engine's reference cycles with `gc.collect`)."""
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()
