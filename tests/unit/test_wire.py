"""The Batch wire format and the by-reference slicing rules, without Ray."""
import pickle

import pytest
import torch

from xray.data.batch import Batch
from xray.data.wire import COPY_BELOW, Ragged
from xray.protocol import DispatchError, PartsSlice, assemble, fanout, fanout_methods, remote_slices

pytestmark = pytest.mark.unit


def roundtrip(batch: Batch) -> Batch:
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers), buffers


def test_tensors_travel_out_of_band_in_any_dtype():
    big = torch.randn(COPY_BELOW // 4 + 1)  # just above the copy threshold
    batch = Batch({"big": big}, meta={"version": 7})
    out, buffers = roundtrip(batch)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == big.numel() * 4  # out of band, not pickled
    assert torch.equal(out["big"], big) and out.meta == {"version": 7}
    small = Batch({"bf": torch.randn(3, 5).to(torch.bfloat16), "ids": torch.arange(12).view(3, 4)[:, 1:]})
    back, _ = roundtrip(small)
    assert back["bf"].dtype == torch.bfloat16 and torch.equal(back["bf"], small["bf"])
    assert torch.equal(back["ids"], small["ids"])  # a non-contiguous view arrives as its values
    back["ids"][0, 0] = -1  # small columns arrive writable


def test_token_lists_become_flat_arrays_and_come_back_equal():
    rows = [[1, 2, 3], [], [4], [5, 6]]
    batch = Batch({"x": torch.zeros(4)}, {"ids": rows, "logp": [[-0.5], [], [-1.25], [0.0, -2.0]],
                                          "text": ["a", "b", "c", "d"]})
    out, buffers = roundtrip(batch)
    assert isinstance(out["ids"], Ragged) and out["ids"] == rows and out["ids"][3] == [5, 6]
    assert out["logp"] == [[-0.5], [], [-1.25], [0.0, -2.0]]
    assert out["text"] == ["a", "b", "c", "d"] and isinstance(out["text"], list)
    part = out.index(slice(1, 3))  # a view of the ragged column
    assert part["ids"] == [[], [4]]
    again, _ = roundtrip(part)
    assert again["ids"] == [[], [4]]
    joined = Batch.concat([again, out.index(slice(3, 4))])
    assert isinstance(joined["ids"], Ragged) and joined["ids"] == [[], [4], [5, 6]]


def test_remote_slices_cover_every_row_once():
    for parts in range(1, 7):
        for replicas in range(1, 7):
            rows_per_part = replicas * 2
            values = [Batch({"x": torch.arange(p * rows_per_part, (p + 1) * rows_per_part)}) for p in range(parts)]
            got = []
            for first, end, skip, take, den in remote_slices(parts, replicas):
                piece = PartsSlice(tuple(range(first, end)), skip, take, den)
                got += assemble(values[first:end], piece)["x"].tolist()
            assert got == list(range(parts * rows_per_part)), (parts, replicas)


def test_uneven_parts_say_how_to_fix():
    values = [Batch({"x": torch.arange(3)})]
    with pytest.raises(DispatchError, match="pass a multiple of 2 rows"):
        assemble(values, PartsSlice((0,), 0, 1, 2))
    with pytest.raises(DispatchError, match="different sizes"):
        assemble([Batch({"x": torch.arange(2)}), Batch({"x": torch.arange(4)})], PartsSlice((0, 1), 0, 2, 1))


def test_reads_declares_the_columns_shipped():
    class W:
        @fanout(dispatch="slice", reads=("a",))
        def f(self, batch):
            return batch

        @fanout(dispatch="slice", reads=lambda args, kwargs: ("a", *kwargs["extra"]))
        def g(self, batch, extra):
            return batch

    meta = fanout_methods(W)
    assert meta["f"].columns((), {}) == ("a",)
    assert meta["g"].columns((), {"extra": ["b"]}) == ("a", "b")
    piece = PartsSlice((0,), 0, 1, 1, ("a",))
    assert assemble([Batch({"a": torch.ones(2), "b": torch.ones(2)})], piece).keys() == ["a"]


def test_actor_and_critic_train_steps_ship_only_their_loss_columns():
    from algorithms.core.policy_loss import PolicyLoss
    from algorithms.ppo.value_loss import ValueLoss
    from xray.data import columns as C
    from xray.workhorse.base import train_step_columns

    policy = set(train_step_columns((None, PolicyLoss(), 4), {}))
    value = set(train_step_columns((None,), {"loss_fn": ValueLoss(), "micro_batch_size": 4}))
    assert policy == {C.INPUT_IDS, C.ATTENTION_MASK, C.LOSS_MASK, C.OLD_LOGPROBS, C.ADVANTAGES}
    assert value == {C.INPUT_IDS, C.ATTENTION_MASK, C.LOSS_MASK, C.OLD_VALUES, C.RETURNS}
    assert train_step_columns((None, lambda outputs, batch: None, 4), {}) is None  # undeclared: all
