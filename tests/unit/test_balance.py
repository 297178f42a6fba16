"""Balanced partitions (`xray/data/balance.py`): every row once, equal sizes, the Karmarkar-Karp
result on a hand-checked case, near the optimum found by brute force on small batches, and far
better than equal row counts on long-tailed lengths; the cost model."""
import itertools
import random

import pytest

from xray.data.balance import balanced_order, partition, row_cost, spread

pytestmark = pytest.mark.unit


def test_hand_checked_two_way_split():
    # sorted 8 7 6 5 4 4: pairs (8,7) (6,5) (4,4) -> spreads 1 1 0; merge (8|7) with (6|5): 8+5, 7+6 -> 13|13
    costs = [4, 8, 5, 7, 4, 6]
    parts = partition(costs, 2)
    assert sorted(len(p) for p in parts) == [3, 3] and spread(costs, parts) == 0
    assert sorted(i for p in parts for i in p) == list(range(6))


def test_near_the_optimum_on_small_batches():
    rng = random.Random(7)
    for _ in range(30):
        costs = [rng.randint(1, 50) for _ in range(8)]
        parts = partition(costs, 2)
        best = min(abs(sum(costs[i] for i in half) * 2 - sum(costs))
                   for half in itertools.combinations(range(8), 4))
        assert [len(p) for p in parts] == [4, 4]
        assert spread(costs, parts) <= best + 10, (costs, parts, best)  # a heuristic: close, not always exact


def test_long_tailed_lengths_balance_far_better_than_equal_row_counts():
    rng = random.Random(3)
    lengths = [rng.randint(40, 80) * (4 if i % 8 == 0 else 1) for i in range(64)]
    rng.shuffle(lengths)
    costs = [row_cost(n, hidden_size=64) for n in lengths]
    for k in (2, 4, 8):
        contiguous = [list(range(j * 64 // k, (j + 1) * 64 // k)) for j in range(k)]
        order = balanced_order(costs, k)
        balanced = [order[j * 64 // k:(j + 1) * 64 // k] for j in range(k)]
        assert sorted(order) == list(range(64))
        slowest = max(sum(costs[i] for i in part) for part in balanced)
        assert slowest <= 1.02 * sum(costs) / k, (k, slowest, sum(costs) / k)  # the step waits on the slowest
        assert spread(costs, balanced) < spread(costs, contiguous) / 5


def test_unequal_sizes_and_errors():
    parts = partition([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, equal_size=False)
    assert sorted(len(p) for p in parts) == [1, 10] and spread([10] + [1] * 10, parts) == 0
    with pytest.raises(ValueError, match="multiple of 4"):
        partition([1, 2, 3], 4)
    with pytest.raises(ValueError, match="k >= 1"):
        partition([1], 0)
    assert row_cost(12) == 12.0 and row_cost(12, hidden_size=4) == 12.0 + 144 / 24
