"""Each way a weight sync can go wrong on its way is caught by the part of the verification meant
for it (`xray/transport/faults.py` injects them): bytes reordered, exchanged or changed in transit by
the checksum, a tensor lost or never sent by the manifest, and an engine layer that computes with
other weights than it was sent (transposed, rows exchanged, another layer's, the previous
version's) by the functional check, in fp32 and bf16. Then through the real ends of every transport
(the sender's pack, the receiver's check, a rollout Workhorse's load and report, the driver's
`check_exact`): two rows swapped caught by the checksum in both families ("xxh3" on the host,
"pw64" in the device form), a checksum family mismatch between the ends caught by the receiver,
and a dtype, shape or byte count changed on the way caught by the manifest alone. The real engines
are checked the same way in tests/backends/test_held_faults.py and through the runtime in
tests/ray/test_weight_sync.py; the coverage of the held check in tests/unit/test_sync_coverage.py."""
import re

import pytest
import torch

from tests.unit.test_sync_transports import over_gloo, through_object_store
from xray.backends.base import GenerationEngine
from xray.backends.held import HeldCheck
from xray.config.parallel import ParallelDims
from xray.sync import WeightSyncError
from xray.sync.manifest import incomplete
from xray.sync.weights import check_exact
from xray.transport import faults, ipc, pg, shm, wire
from xray.transport.faults import in_transit, on_export
from xray.transport.wire import changed_in_transit, manifest_of, pack_bucket, verified
from xray.workhorse.rollout import RolloutWorkhorse

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_functional_check_sees_a_layer_one_optimizer_step_stale_at_a_real_width(dtype):
    """Width 2048: the engine computes with the weights before one Adam step at lr 1e-5 (every
    element moved 1e-5, as Adam's first step moves it), or with two output rows exchanged. The
    random rows' bound alone passes the stale layer (its product moves ~5e-4, the bound is ~2e-2);
    the columns read back through the kernel catch it, in bf16 too (where the step changes only
    the elements whose bf16 value it crosses)."""
    g = torch.Generator().manual_seed(0)
    before = torch.randn(256, 2048, generator=g) * 0.02
    sent = before - 1e-5 * torch.sign(torch.randn(256, 2048, generator=g))  # after the step
    changed = float((before.to(dtype) != sent.to(dtype)).float().mean())
    assert changed > 0.01, changed  # the step is visible in the engine's dtype
    for what, weight in {"right": sent, "one step stale": before, "rows exchanged": sent[[1, 0, *range(2, 256)]]}.items():
        check = HeldCheck()
        packed = weight.to(dtype)
        check.compare_product("mlp.down_proj.weight", lambda x: x @ packed.t(), 2048, sent, dtype)
        counts = check.take()
        if what == "right":
            assert counts["functional"] == 1 and counts["mismatched"] == [], counts
        else:
            assert counts["functional"] == 0 and len(counts["mismatched"]) == 1, (what, counts)
            assert "read back through its kernel differs from what was sent" in counts["mismatched"][0], counts
    # the random rows' bound alone would have passed the stale layer
    x = torch.randn(4, 2048, generator=g)
    moved = float((x @ (sent - before).t()).abs().max())
    assert moved < 2e-3, moved


# -- through the real ends: the sender's pack, a transport's receiver, a rollout Workhorse's load and
# report, and the driver's judgment (`check_exact`) ------------------------------------------------

class DictEngine(GenerationEngine):
    """A generation engine that keeps what it is sent (clones, whatever their dtype and shape) and
    checks it bit for bit, by name, as DeepSpeed-Inference checks its parameters. `skips`: names
    its check passes over without a verdict; `twice`: names it counts twice; `says_holds`: whether
    it names the tensors its loads wrote; `checks`: whether it checks at all (False: the base
    class's held check, which returns nothing); `extra`: checks counted without a name."""

    def __init__(self, skips=(), twice=(), says_holds=True, checks=True, extra=0):
        self.params: dict[str, torch.Tensor] = {}
        self.held, self.holds = HeldCheck(), []
        self.skips, self.twice, self.says_holds, self.checks, self.extra = set(skips), set(twice), says_holds, checks, extra

    def load_weights(self, bucket, check=True):
        for name, tensor in bucket:
            self.params[name] = tensor.clone()
            self.holds.append(name)
        for name, tensor in bucket if check else []:
            for _ in range(2 if name in self.twice else 0 if name in self.skips else 1):
                if not self.held.compare(name, self.params[name], tensor):
                    self.held.skip([name])
        self.held.exact += self.extra if check else 0

    def held_check(self):
        return self.held.take() if self.checks else super().held_check()

    def held_tensors(self):
        holds, self.holds = self.holds, []
        return holds if self.says_holds else None

    def generate(self, prompts, sampling):
        raise NotImplementedError

    def logprobs(self, sequences, prompt_lens):
        raise NotImplementedError


def receiver(engine: GenerationEngine | None = None) -> RolloutWorkhorse:
    workhorse = RolloutWorkhorse("rollout", 0, ParallelDims(), threads=torch.get_num_threads(), backend="vllm",
                                 model_dir="unused")
    workhorse.engine = engine or DictEngine()
    return workhorse


def sync_through(transport: str, sent, fault: str | None = None, engine: GenerationEngine | None = None) -> dict:
    """One sync of `sent` to a rollout Workhorse by `transport` ("objstore": the wire form through
    pickle as Ray moves it; "shm": the slots; "flat": the device transports' form, "pw64" on a CPU
    buffer, as `load_ipc` takes it after opening its handle; "pg": a gloo group of two threads),
    `fault` applied by the sender; the replica's `finish_sync` report."""
    shard = receiver(engine)
    shard.abort_sync()
    if transport == "objstore":
        shard.load_bucket(through_object_store(in_transit(pack_bucket(sent), fault)))
    elif transport == "shm":
        ring = shm.SendRing("faults")
        try:
            shard.load_slot(*ring.write(in_transit(pack_bucket(sent), fault)))
        finally:
            ring.close()
    elif transport == "flat":
        buffer = torch.zeros(ipc.layout_size(sent), dtype=torch.uint8)
        layout = ipc.pack_into(buffer, sent, fault)
        shard._take(*ipc.views(buffer, layout), verified(layout))
    else:
        def send(group):
            flat, layout = pg.pack(sent, "cpu")
            return flat, faults.in_buffer(flat, layout, fault)

        def receive(group, layout, size):
            shard._sync_group = group
            return shard.receive_bucket(layout, size)
        over_gloo("cpu", send, receive)
    return shard.finish_sync(1)


TRANSPORTS = ["objstore", "shm", "flat", "pg"]
A = "layers.0.o_proj.weight"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_rows_swapped_in_transit_fail_the_exact_check_in_either_family(transport):
    sent = model()
    clean = sync_through(transport, sent)
    assert clean["changed_in_transit"] == [] and clean["held"]["exact"] == 3
    assert check_exact(1, [clean], manifest_of(sent))["exact"] == 3  # the same sync, unbroken, passes
    report = sync_through(transport, sent, f"rows:{A}")
    assert report["changed_in_transit"] == [A]
    assert report["held"]["exact"] == 3  # the engine holds what arrived: only the checksum sees the order
    with pytest.raises(WeightSyncError, match=r"version 1 failed verification: 1 tensor\(s\) changed in transit "
                                              r"\(layers\.0\.o_proj\.weight\)"):
        check_exact(1, [report], manifest_of(sent))


@pytest.mark.parametrize("transport,named,checks", [("objstore", "pw64", "xxh3"), ("shm", "pw64", "xxh3"),
                                                    ("flat", "xxh3", "pw64"), ("pg", "pw64", "xxh3")])
def test_a_checksum_family_mismatch_between_the_ends_fails_the_load(transport, named, checks):
    with pytest.raises(WeightSyncError, match=f"the sender named '{named}', this receiver's transport checks '{checks}'"):
        sync_through(transport, model(), f"family:{named}")


def test_a_receiver_refuses_a_family_it_does_not_know_or_a_value_of_another_family():
    sent = model()
    with pytest.raises(WeightSyncError, match="'md5', unknown to this receiver.*xxh3, pw64.*same xray version"):
        sync_through("objstore", sent, "family:md5")
    buffer = torch.zeros(ipc.layout_size(sent), dtype=torch.uint8)
    layout = wire.pack_into(buffer, sent, wire.XXH3)  # hashed on the host ...
    layout = [(*entry[:5], (wire.PW64, entry[5][1])) for entry in layout]  # ... named as the device form
    with pytest.raises(WeightSyncError, match="named 'pw64' but sent the 'xxh3' checksum of these bytes"):
        ipc.views(buffer, layout)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault,received", [("reshape", "float32 [1, 4096] 16384 bytes"),
                                            ("retype", "int32 [64, 64] 16384 bytes")])
def test_metadata_changed_in_transit_is_caught_by_the_manifest_alone(transport, fault, received):
    sent = model()
    report = sync_through(transport, sent, f"{fault}:{A}")
    assert report["changed_in_transit"] == [] and report["held"]["mismatched"] == []  # the bytes are the same
    with pytest.raises(WeightSyncError, match=re.escape(
            f"received 1 tensor(s) otherwise than the actor's manifest lists them: {A} (sent float32 [64, 64] 16384 "
            f"bytes, received {received})")):
        check_exact(1, [report], manifest_of(sent))


def test_a_tensor_received_in_fewer_bytes_than_sent_is_caught_by_the_manifest():
    sent = model()
    narrowed = [(n, t.to(torch.bfloat16) if n == A else t) for n, t in sent]  # cast after the manifest was taken
    report = sync_through("objstore", narrowed)
    with pytest.raises(WeightSyncError, match=re.escape(f"{A} (sent float32 [64, 64] 16384 bytes, received "
                                                        "bfloat16 [64, 64] 8192 bytes)")):
        check_exact(1, [report], manifest_of(sent))


def test_an_export_fault_that_cannot_be_applied_says_so():
    """`rename:A,B` exchanges two tensors of one bucket; a pair split over two buckets fails the
    push instead of sending the weights unchanged (a fault test would then pass for nothing)."""
    a, b = torch.ones(2, 2), torch.zeros(2, 2)
    fault = "rename:layers.0.o_proj.weight,layers.9.o_proj.weight"
    swapped = on_export([("layers.0.o_proj.weight", a), ("layers.9.o_proj.weight", b)], fault)
    assert [n for n, _ in swapped] == ["layers.9.o_proj.weight", "layers.0.o_proj.weight"]
    assert on_export([("norm.weight", a)], fault) == [("norm.weight", a)]  # neither: nothing to do here
    with pytest.raises(ValueError, match="in different export buckets"):
        on_export([("layers.0.o_proj.weight", a), ("norm.weight", b)], fault)
