"""`payload_bytes` and the inline-or-shared rule of a WholeModel call's arguments
(`xray/wholemodel/handle.py`): small or unshared parts travel inside the shard calls."""
import numpy as np
import torch

from xray.data.batch import Batch
from xray.wholemodel.handle import INLINE_BYTES, _shared_or_inline, payload_bytes


def test_sizes_add_up_from_tensors_lists_and_scalars():
    batch = Batch({"x": torch.zeros(4, 8, dtype=torch.long)}, {"ids": [[1, 2], [3]] * 2}, {"version": 3})
    tensors = 8 + (16 + 1) + (256 + 4 * 8 * 8)  # the dict, its key, the tensor's bytes
    lists = 8 + (16 + 3) + (8 + 8 * 4) + 2 * (8 + 8 * 2) + 2 * (8 + 8 * 1) + 6 * 16
    meta = 8 + (16 + 7) + 16
    assert payload_bytes(batch) == tensors + lists + meta
    packed = ((np.zeros(10, np.float32),), {"n": 1})
    assert payload_bytes(packed) == (8 + 8 * 2) + (8 + 8) + (256 + 40) + (8 + (16 + 1) + 16)


def test_counting_stops_early_and_unknown_objects_count_as_large():
    big = list(range(10 ** 7))
    assert INLINE_BYTES < payload_bytes([big]) < 2 * 8 * 10 ** 7  # no walk over ten million items
    assert payload_bytes(object()) > INLINE_BYTES
    assert payload_bytes(torch.zeros(INLINE_BYTES // 4)) > INLINE_BYTES


def test_only_a_large_shared_part_would_go_to_the_object_store():
    small = ((Batch({"x": torch.zeros(16)}),), {})
    large = ((Batch({"x": torch.zeros(INLINE_BYTES)}),), {})
    assert _shared_or_inline(small, users=4) is small
    assert _shared_or_inline(large, users=1) is large  # one shard takes it: Ray itself stores it
