"""Each way a weight sync can go wrong on its way is caught by the part of the verification meant
for it (`xray/transport/faults.py` injects them): bytes reordered, exchanged or changed in transit by
the checksum, a tensor lost or never sent by the manifest, and an engine layer that computes with
other weights than it was sent (transposed, rows exchanged, another layer's, the previous
version's) by the functional check, in fp32 and bf16. The real engines are checked the same way in
tests/backends/test_held_faults.py and through the runtime in tests/ray/test_weight_sync.py."""
import pytest
import torch

from xray.backends.held import HeldCheck
from xray.sync.manifest import incomplete
from xray.transport.faults import in_transit, on_export
from xray.transport.wire import changed_in_transit, manifest_of, pack_bucket

pytestmark = pytest.mark.unit


def model(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.o_proj.weight", 0.02 * torch.randn(64, 64, generator=g)) for i in range(2)] + \
           [("norm.weight", torch.ones(64))]


@pytest.mark.parametrize("fault", ["perturb:layers.0.o_proj.weight", "swap:layers.0.o_proj.weight,layers.1.o_proj.weight",
                                   "rows:layers.1.o_proj.weight", "transpose:layers.0.o_proj.weight"])
def test_the_checksum_catches_bytes_changed_reordered_or_exchanged_in_transit(fault):
    wire = pack_bucket(model())
    assert changed_in_transit(wire) == []
    hit = changed_in_transit(in_transit(wire, fault))
    assert hit == fault.split(":")[1].split(","), hit


def test_the_manifest_catches_a_tensor_lost_or_never_sent_or_loaded_twice():
    bucket = model()
    names = {"needs": [n for n, _ in bucket], "takes": [n for n, _ in bucket]}
    manifest = manifest_of(bucket)
    loaded = [e[0] for e in in_transit(pack_bucket(bucket), "drop:norm.weight")]
    assert incomplete(manifest, {"loaded": [n for n, _ in bucket], "names": names}) == []
    assert incomplete(manifest, {"loaded": loaded, "names": names}) == [
        "1 tensor(s) sent but never loaded (norm.weight)", "1 tensor(s) the engine needs were not sent (norm.weight)"]
    unsent = on_export(bucket, "unsent:norm.weight")
    assert incomplete(manifest_of(unsent), {"loaded": [n for n, _ in unsent], "names": names}) == [
        "1 tensor(s) the engine needs were not sent (norm.weight)"]
    twice = incomplete(manifest, {"loaded": [n for n, _ in bucket] + ["norm.weight"], "names": names,
                                  "waiting": ["x.q_proj.weight"]})
    assert twice[0].startswith("1 tensor(s) loaded more than once (norm.weight)") and "held back" in twice[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_functional_check_catches_a_layer_holding_other_weights(dtype):
    old, new = dict(model(0)), dict(model(1))
    sent = new["layers.0.o_proj.weight"]
    held_as = {"right": sent, "transposed": sent.t(), "rows exchanged": sent[[1, 0, *range(2, 64)]],
               "another layer's": new["layers.1.o_proj.weight"], "the previous version's": old["layers.0.o_proj.weight"],
               "nudged": sent + 1e-3 * sent.abs().max()}
    for what, weight in held_as.items():
        check = HeldCheck()
        packed = weight.to(dtype)  # what the engine computes with (its own matmul, in its dtype)
        check.compare_product("o_proj.weight", lambda x: x @ packed.t(), 64, sent, dtype)
        counts = check.take()
        if what == "right":
            assert counts["functional"] == 1 and counts["mismatched"] == [], counts
        else:
            assert counts["functional"] == 0 and len(counts["mismatched"]) == 1, (what, counts)
            assert "held otherwise than sent" in counts["mismatched"][0]
