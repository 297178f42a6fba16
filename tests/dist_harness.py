"""Run a function on N local processes joined in a gloo group: the test bench for backend engines.

Backend engines expect an initialised torch.distributed default group (the Workhorse makes one in
production). Engine-level tests use this to get the same without Ray: real processes, real gloo.
`fn(rank, world_size, *args)` must be a module-level function; its return values come back in
rank order, and a failure on any rank raises with that rank's traceback. Return numpy arrays or
plain Python, not torch tensors: torch shares tensors between processes by file descriptor, and
the child has exited by the time the parent reads them.

On the CPU the ranks are forked from one `forkserver` process per test session that imported the engines'
libraries once (`PRELOAD`: torch, transformers, megatron-core, DeepSpeed; about 5 s of CPU per
rank when each rank imported them itself, spawned). Nothing runs in the server but those imports:
each rank starts from the state of a fresh import, makes its own process group and engine, and
exits. A rank's environment is the test's at the call (`os.environ` is handed over and replaces
the server's). The ranks join at a rendezvous point this process serves for the call
(`xray/transport/rendezvous.py`: bound before the ranks hear of its port), as Workhorses do.
"""
from __future__ import annotations

import os
import queue as queue_module
import time
import traceback

import torch.multiprocessing as mp

from xray.transport.rendezvous import open_point, store_at


PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "megatron.core", "deepspeed"]
"""Imported once by the session's fork server; a missing one is skipped (multiprocessing's rule)."""


def _context(backend: str):
    """The fork server on the CPU; spawned processes for "nccl", where an import that asked CUDA
    for its devices (DeepSpeed's accelerator detection does) would leave the forks unable to use it."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, queue, backend="gloo", environ=None):
    import torch
    import torch.distributed as dist

    from xray.transport.rendezvous import join_world

    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        # a client of the parent's point; LOCAL_RANK the rank: DeepSpeed picks its device by it
        join_world(backend, "127.0.0.1", port, rank, world_size, 300.0, local_rank=rank)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo") -> list:
    """`fn(rank, world_size, *args)` on `world_size` processes in a `backend` group ("gloo", or
    "nccl": rank r on GPU r); their answers in rank order."""
    ctx = _context(backend)
    queue = ctx.Queue()
    _, port = open_point("127.0.0.1")  # served by this process, bound before the ranks hear of it
    point = store_at("127.0.0.1", port, world_size, timeout)  # kept alive until the ranks are done
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, backend, environ), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world_size and not errors:
            try:
                rank, ok, value = queue.get(timeout=1.0)
                (results if ok else errors)[rank] = value
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                errors[dead[0]] = f"process exited with code {procs[dead[0]].exitcode} (killed by a signal if < 0)"
            elif time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in results]
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
        del point
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]


def as_bytes(obj) -> bytes:
    """`obj` torch.save'd: a rank's result holding tensors sent this way survives the rank's exit
    (tensors put on the queue as they are live in shared memory that the exit takes away)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)
