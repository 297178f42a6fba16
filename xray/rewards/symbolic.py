"""Symbolic equivalence of two final answers with the `math-verify` package, in worker processes.

Sits under `xray/rewards/`, below the `math_verify` reward (`math_answer.py`), which extracts the
answers and asks `verify_answers` about the pairs it cannot settle as plain numbers. math-verify
bounds its own work with `signal.alarm`, which works only in a process's main thread (and cannot
stop a long integer power in C); so its timeouts are off here and each pair runs in a
`ProcessPool` worker under a deadline the parent keeps (`pool.map_timed`): a pair past it counts
as not equal and the workers are replaced. One pool per worker count, per process.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Sequence

from xray.rewards.pool import TIMED_OUT, ProcessPool

TIMEOUT_S = 10.0
"""The default time one (gold, answer) pair may take in a worker before it scores 0."""
WORKERS = max(1, min(4, os.cpu_count() or 1))
"""The default number of math-verify worker processes."""

_pools: dict[int, ProcessPool] = {}
_pools_lock = threading.Lock()


def _quiet_import() -> None:
    """A worker's initializer: import math-verify, silence its "timeout is disabled" warnings (the
    parent keeps the deadline) and warm sympy's caches on a trivial pair."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    equivalent(("1", "1"))


def _parsed(text: str):
    from math_verify import parse

    return parse(text if "$" in text or "\\boxed" in text else f"${text}$", parsing_timeout=None)


def equivalent(pair: tuple[str, str]) -> Optional[bool]:
    """Whether `answer` equals `gold` symbolically (run in a worker); None when `gold` does not
    parse. An error inside math-verify on the answer counts as not equal: a model's odd output
    must not stop the run."""
    from math_verify import verify

    gold, answer = pair
    try:
        g = _parsed(gold)
    except Exception:  # noqa: BLE001 - an unparsable gold answer is no score
        return None
    if not g:
        return None
    try:
        a = _parsed(answer)
        return bool(a) and bool(verify(g, a, timeout_seconds=None))
    except Exception:  # noqa: BLE001
        return False


def pool(workers: int = WORKERS) -> ProcessPool:
    """This process's math-verify pool of `workers` processes (started on first use)."""
    with _pools_lock:
        if workers not in _pools:
            _pools[workers] = ProcessPool(workers, initializer=_quiet_import)
        return _pools[workers]


def verify_answers(pairs: Sequence[tuple[str, str]], timeout_s: float = TIMEOUT_S,
                   workers: int = WORKERS) -> list[Optional[bool]]:
    """For each (gold, answer) pair: True when math-verify finds them equal, False when not (or
    when the pair ran past `timeout_s`), None when the gold answer does not parse."""
    if not pairs:
        return []
    found = pool(workers).map_timed(equivalent, list(pairs), timeout_s)
    return [False if r is TIMED_OUT else r for r in found]
