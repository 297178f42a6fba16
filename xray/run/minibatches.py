"""How a step's experience becomes mini-batches: a seeded shuffle per epoch, cut in equal parts
per trainer, and each mini-batch's rows balanced over the actor's data-parallel replicas by cost
(`xray/data/balance.py`). The step's train phase (`xray/run/step.py`) uses them.
"""
from __future__ import annotations

import torch

from xray.data import columns as C
from xray.data.balance import balanced_order, row_cost
from xray.data.batch import Batch


def mini_batch_rows(n: int, mini_batch_size: int, parts: int, seed: int) -> list[torch.Tensor]:
    """One epoch's mini-batches of rows 0..n-1, shuffled: each is the concatenation, in part order,
    of `mini_batch_size / parts` rows of each of `parts` equal contiguous parts (with one part,
    a plain seeded shuffle cut in order)."""
    size, share = n // parts, mini_batch_size // parts
    orders = [p * size + torch.randperm(size, generator=torch.Generator().manual_seed(seed + 104_729 * p))
              for p in range(parts)]
    return [torch.cat([order[start:start + share] for order in orders]) for start in range(0, size, share)]


def balanced_rows(exp: Batch, rows: torch.Tensor, replicas: int, hidden_size: int = 0) -> torch.Tensor:
    """A mini-batch's `rows` reordered so that each of `replicas` consecutive equal slices (what
    each data-parallel replica trains) costs about the same (`xray.data.balance`: Karmarkar-Karp
    on tokens and attention); as they are with one replica."""
    if replicas <= 1 or len(rows) % replicas:
        return rows
    lengths = exp[C.ATTENTION_MASK].index_select(0, rows).sum(1).tolist()
    return rows[balanced_order([row_cost(int(n), hidden_size) for n in lengths], replicas)]
