"""The weight sync's checksum (`xray/transport/wire.py`) sees order: a change of order or offset of
a tensor's bytes in transit changes it, on the host (XXH3) and in the position-weighted form used
in GPU memory (computed here on the CPU)."""
import numpy as np
import pytest
import torch

from xray.transport.wire import CHECKSUM_BLOCK, checksum, pack_bucket, position_weighted

pytestmark = pytest.mark.unit


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fn", [checksum, position_weighted], ids=["host", "device-form"])
def test_reordered_or_shifted_bytes_change_the_checksum(fn):
    w = torch.randn(64, CHECKSUM_BLOCK // 4 + 3, generator=torch.Generator().manual_seed(0))
    base = fn(as_bytes(w))
    assert fn(as_bytes(w.clone())) == base  # deterministic
    rows = w.clone()
    rows[[3, 40]] = rows[[40, 3]]  # two rows swapped: the same multiset of words
    assert fn(as_bytes(rows)) != base
    assert fn(as_bytes(w[:, :-2].t().contiguous())) != fn(as_bytes(w[:, :-2].contiguous()))  # transposed
    raw = as_bytes(w)
    shifted = torch.cat([raw[8:], raw[:8]])  # the same words one slot along (an offset bug)
    assert fn(shifted) != base
    inside = as_bytes(w).clone().view(torch.int64)
    inside[[0, 1]] = inside[[1, 0]]  # two words swapped inside one block
    assert fn(inside.view(torch.uint8)) != base
    changed = w.clone()
    changed[7, 5] += 1e-3
    assert fn(as_bytes(changed)) != base


def test_the_wire_checksum_is_the_host_checksum_of_the_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    (_, _, _, data, sent), = pack_bucket([("x", t)])
    assert sent == checksum(data) == checksum(torch.from_numpy(np.array(data)))
    odd = as_bytes(t)[3:1003]  # an unaligned view with a tail of < 8 bytes
    assert position_weighted(odd) == position_weighted(odd.clone())
