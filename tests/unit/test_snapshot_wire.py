"""A snapshot's files as they travel through the object store (`xray.backends.snapshot.to_wire`):
every tensor a numpy array (bfloat16 as its int16 bytes), back bit for bit, in writable memory of
its own, with the containers' types kept."""
import collections

import numpy as np
import pytest
import torch

from xray.backends.snapshot import WireTensor, from_wire, to_wire

pytestmark = pytest.mark.unit


def test_tensors_travel_as_numpy_and_come_back_bit_for_bit():
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    state = {"model": collections.OrderedDict(w=bf16, b=torch.arange(4)[1::2]),
             "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(2, 2)}},
                           "param_groups": [{"lr": 1e-3, "params": [0]}]},
             "rng": (torch.get_rng_state(), 3), "flag": torch.tensor([True, False])}
    wire = to_wire(state)
    assert isinstance(wire["model"]["w"], WireTensor) and wire["model"]["w"].array.dtype == np.int16
    assert isinstance(wire["model"], collections.OrderedDict) and isinstance(wire["rng"], tuple)
    back = from_wire(wire)
    assert back["model"]["w"].dtype == torch.bfloat16 and torch.equal(back["model"]["w"], bf16)
    assert torch.equal(back["model"]["b"], torch.tensor([1, 3]))  # a strided view: its values
    assert torch.equal(back["optimizer"]["state"][0]["step"], torch.tensor(7.0))
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(back["rng"][0], state["rng"][0]) and back["rng"][1] == 3
    assert back["flag"].dtype == torch.bool and back["flag"].tolist() == [True, False]
    wire["optimizer"]["state"][0]["exp_avg"].array.setflags(write=False)  # as the object store maps it
    original = state["optimizer"]["state"][0]["exp_avg"]
    kept = original.clone()
    again = from_wire(wire)["optimizer"]["state"][0]["exp_avg"]
    again.add_(1.0)  # its own writable memory: an optimizer may update it in place
    assert torch.equal(again, kept + 1.0) and torch.equal(original, kept)


def test_a_disk_write_reads_the_mapped_arrays_in_place():
    """`from_wire(copy=False)`: tensors over the arrays' memory, read-only as Ray maps them, written
    by torch.save as they are (`TrainWorkhorse.persist_snapshot` writes a handed snapshot so)."""
    import io

    bf16 = torch.randn(4, 3).to(torch.bfloat16)
    wire = to_wire({"w": bf16, "n": torch.arange(6.0)})
    for value in wire.values():
        value.array.setflags(write=False)
    view = from_wire(wire, copy=False)
    assert view["w"].dtype == torch.bfloat16 and torch.equal(view["w"], bf16)
    assert view["n"].data_ptr() == wire["n"].array.ctypes.data  # no copy
    buffer = io.BytesIO()
    torch.save(view, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["w"], bf16)
