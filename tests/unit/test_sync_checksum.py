"""The weight sync's checksum families (`xray/transport/wire.py`) see order: a change of order or
offset of a tensor's bytes in transit changes them, on the host ("xxh3") and in the
position-weighted form used in GPU memory ("pw64", computed here on the CPU); each is computed the
same wherever the bytes lie, and a family nobody knows is refused."""
import numpy as np
import pytest
import torch

from xray.transport.errors import WeightSyncError
from xray.transport.wire import CHECKSUM_BLOCK, PW64, XXH3, checksum, family_for, pack_bucket, position_weighted, xxh3

pytestmark = pytest.mark.unit


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("fn", [xxh3, position_weighted], ids=["host", "device-form"])
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


def test_the_wire_checksum_is_the_named_host_checksum_of_the_bytes():
    t = torch.arange(1000, dtype=torch.float32)
    (_, _, _, data, sent), = pack_bucket([("x", t)])
    assert sent == (XXH3, checksum(data, XXH3)) == (XXH3, checksum(torch.from_numpy(np.array(data)), XXH3))
    assert checksum(data, PW64) == position_weighted(as_bytes(t))  # either family of host bytes, on the CPU
    assert checksum(data, PW64) != checksum(data, XXH3)
    odd = as_bytes(t)[3:1003]  # an unaligned view with a tail of < 8 bytes
    assert position_weighted(odd) == position_weighted(odd.clone())
    assert (family_for("cpu"), family_for("cuda"), family_for(torch.device("cuda", 1))) == (XXH3, PW64, PW64)
    with pytest.raises(WeightSyncError, match="checksum family 'crc32' is unknown here.*xxh3, pw64.*same xray"):
        checksum(data, "crc32")
