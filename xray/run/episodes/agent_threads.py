"""Where a synchronous `env.agent` function runs: threads of its own, as many as the episodes in
flight, its timeout counted from the moment it starts running.

Sits under `xray/run/episodes/agents.py` (which calls the user's agent once per sample). Python's
default executor (`asyncio.to_thread`) has min(32, cpus + 4) threads: at a few hundred agents most
wait in its queue, and a timeout around the queued call counts that wait against `env.timeout_s`,
so they end as `timeout` without having run long. `AgentThreads` is one play's pool, sized to its
episodes (`MAX_THREADS` at most), and `call` starts an agent's clock when a thread picks it up.
A thread cannot be stopped from outside: an agent past its timeout ends its episode, and keeps its
thread until it returns; each play has a new pool, so no agent waits behind another play's late
ones, and closing a pool does not wait for them.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

MAX_THREADS = 1024
"""Threads of one play's pool at most (agents beyond wait for one, their clocks not started)."""


class AgentThreads:
    """A pool of `size` threads (`MAX_THREADS` at most) for synchronous agent calls."""

    def __init__(self, size: int):
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(size, MAX_THREADS)), thread_name_prefix="xray-agent")

    async def call(self, fn: Callable[..., Any], timeout_s: float, *args: Any) -> Any:
        """`fn(*args)` in a thread of the pool; `asyncio.TimeoutError` once it has run `timeout_s`
        seconds (the time it waited for a thread not counted)."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def run() -> Any:
            at = time.monotonic()
            loop.call_soon_threadsafe(lambda: started.done() or started.set_result(at))
            return fn(*args)

        result = loop.run_in_executor(self.pool, run)
        try:
            await asyncio.wait([started, result], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            result.cancel()
            raise
        if result.done() and not started.done():  # it never ran (the pool was closed)
            return result.result()
        at = started.result() if started.done() else await started
        return await asyncio.wait_for(result, max(0.0, timeout_s - (time.monotonic() - at)))

    def close(self) -> None:
        """No new calls; the running ones go on in their threads, not waited for."""
        self.pool.shutdown(wait=False, cancel_futures=True)
