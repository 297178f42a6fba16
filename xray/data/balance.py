"""Balanced partitions of a batch's rows: which rows go to which data-parallel rank (or micro-batch)
so that each part costs about the same.

Sits in the data layer, beside length grouping (`xray/data/lengths.py`); the PPO and critic-free
trainers order each mini-batch's rows with it before the data-parallel slice
(`xray.run.step.balanced_rows`), which the mini-batch's loss totals make exact
(`xray.data.lengths.with_totals`). Why: data-parallel ranks wait
for each other at every gradient reduction, so a step lasts as long as its most expensive rank.
Equal row counts are not equal work when lengths vary: with one row in eight four times as long,
one rank may get most of the long rows.

`partition` is the Karmarkar-Karp largest differencing method for k parts (the multi-way form):
every item starts as a k-tuple of part sums holding it alone; the two tuples of largest spread
(largest part minus smallest) are merged, the largest part of one with the smallest of the other,
until one tuple is left. With `equal_size` the items, sorted, are first taken k at a time into
tuples of k one-item parts, so every part ends with the same number of items (what a rank's
share of a mini-batch needs). It is a heuristic (the problem is NP-hard): near-optimal on the
long-tailed costs of rollouts. `partition` keeps the better of it and a greedy longest-first
assignment, then swaps rows between the costliest and the cheapest part while that helps.

`row_cost` is the cost model: a row's tokens for the linear layers plus its attention's quadratic
term, weighted for the model's width.
"""
from __future__ import annotations

import heapq
from typing import Sequence


def row_cost(tokens: int, hidden_size: int = 0) -> float:
    """A forward and backward's relative cost of one row of `tokens` tokens: the linear layers'
    ~24 h^2 flops per token per layer plus attention's ~4 h L, i.e. proportional to
    L + L^2 / (6 h); `hidden_size` 0: linear in tokens."""
    if tokens < 0:
        raise ValueError(f"a row cannot have {tokens} tokens")
    return float(tokens) + (tokens * tokens / (6.0 * hidden_size) if hidden_size > 0 else 0.0)


def spread(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """The largest part's cost minus the smallest's."""
    sums = [sum(costs[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def partition(costs: Sequence[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """`range(len(costs))` in `k` parts of about equal total cost (see the module docstring); each
    part's indices ascending. With `equal_size`, `len(costs)` must be a multiple of `k`."""
    n = len(costs)
    if k < 1:
        raise ValueError(f"cannot make {k} parts; give k >= 1")
    if equal_size and n % k:
        raise ValueError(f"{n} rows do not split into {k} parts of equal size; give a multiple of {k} rows "
                         "or equal_size=False")
    if any(c < 0 for c in costs):
        raise ValueError("costs must not be negative")
    best = min((_karmarkar_karp(costs, k, equal_size), _longest_first(costs, k, equal_size)),
               key=lambda parts: spread(costs, parts))
    return [sorted(p) for p in _refine(costs, best)]


def _karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    if equal_size:
        seeds = [[[i] for i in order[start:start + k]] for start in range(0, len(order), k)]
    else:
        seeds = [[[i]] + [[] for _ in range(k - 1)] for i in order]
    heap = []
    for serial, parts in enumerate(seeds):
        sums = [sum(costs[i] for i in p) for p in parts]
        heap.append((-(max(sums) - min(sums)), serial, list(zip(sums, parts))))
    heapq.heapify(heap)
    serial = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda x: x[0])  # smallest of one with the largest of the other
        b.sort(key=lambda x: -x[0])
        merged = [(sa + sb, pa + pb) for (sa, pa), (sb, pb) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), serial, merged))
        serial += 1
    return [p for _, p in heap[0][2]] if heap else [[] for _ in range(k)]


def _refine(costs: Sequence[float], parts: list[list[int]], rounds: int = 1000) -> list[list[int]]:
    """Swaps of one row of the costliest part with one of the cheapest while that lowers the
    costlier of the two (sizes kept): a local search after the construction."""
    sums = [sum(costs[i] for i in p) for p in parts]
    for _ in range(rounds):
        hi, lo = max(range(len(parts)), key=lambda j: sums[j]), min(range(len(parts)), key=lambda j: sums[j])
        gap = sums[hi] - sums[lo]
        best, swap = 0.0, None
        for a, i in enumerate(parts[hi]):
            for b, j in enumerate(parts[lo]):
                d = costs[i] - costs[j]  # moved from hi to lo
                if 0 < d < gap and min(d, gap - d) > best:
                    best, swap = min(d, gap - d), (a, b, d)
        if swap is None:
            break
        a, b, d = swap
        parts[hi][a], parts[lo][b] = parts[lo][b], parts[hi][a]
        sums[hi] -= d
        sums[lo] += d
    return parts


def _longest_first(costs: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """Greedy: each row, most expensive first, to the cheapest part that still has room."""
    room = len(costs) // k if equal_size else len(costs)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min((j for j in range(k) if len(parts[j]) < room), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += costs[i]
    return parts


def balanced_order(costs: Sequence[float], k: int) -> list[int]:
    """A permutation of the rows whose `k` consecutive equal slices are `partition`'s parts (what a
    data-parallel dispatch that cuts a batch into contiguous slices needs)."""
    return [i for part in partition(costs, k, equal_size=True) for i in part]
