"""Batch: split / concat / select / index keep rows aligned across tensor and list columns."""
import pickle

import pytest
import torch

from xray.data.batch import Batch, BatchError

pytestmark = pytest.mark.unit


def make(n=6):
    return Batch({"x": torch.arange(n * 2).view(n, 2), "y": torch.arange(n).float()},
                 {"text": [f"t{i}" for i in range(n)]}, {"version": 3})


def test_split_concat_roundtrip():
    b = make()
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["text"] == ["t2", "t3"]
    assert parts[2]["x"].tolist() == [[8, 9], [10, 11]]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["text"] == b["text"] and back.meta == {"version": 3}


def test_uneven_split_says_fix():
    with pytest.raises(BatchError, match="multiple of 4"):
        make(6).split(4)


def test_mismatched_columns_rejected():
    with pytest.raises(BatchError, match="different leading sizes"):
        Batch({"x": torch.zeros(3)}, {"t": [1, 2]})
    with pytest.raises(BatchError, match="columns"):
        Batch.concat([make(2), make(2).select(["x"])])


def test_index_select_and_setitem():
    b = make()
    sub = b.index([5, 0])
    assert sub["y"].tolist() == [5.0, 0.0] and sub["text"] == ["t5", "t0"]
    assert b.select(["y"]).keys() == ["y"]
    b["z"] = torch.ones(6)
    assert b["z"].sum().item() == 6
    with pytest.raises(BatchError, match="rows"):
        b["bad"] = torch.ones(5)


def test_chunks_and_pickle():
    b = make(8)
    assert [c["y"][0].item() for c in b.chunks(4)] == [0.0, 4.0]
    with pytest.raises(BatchError, match="micro-batch size 3"):
        b.chunks(3)
    c = pickle.loads(pickle.dumps(b))
    assert torch.equal(c["x"], b["x"]) and c["text"] == b["text"]
    assert b.nbytes() == 8 * 2 * 8 + 8 * 4
