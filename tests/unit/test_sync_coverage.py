"""No engine tensor counted as checked that was not (`xray/sync/coverage.py`): per replica, exact +
functional + unchecked must be the tensors the engine's loads wrote, one verdict each, through a
rollout Workhorse's real load and report and the driver's `check_exact`; a held check that skips a
tensor, counts one twice, counts without naming, returns nothing, or an engine that does not say
what it holds, fails the sync naming the fix. The held counts are measured and reach the step's
metrics (`sync/held_exact`, `sync/held_functional`, `sync/unchecked`) only when the sync was
verified: absent, not 0, with `sync.verify=false`."""
from __future__ import annotations

import concurrent.futures
import types

import pytest

from tests.unit.test_sync_faults import DictEngine, model, sync_through
from xray.backends.held import HeldCheck
from xray.sync import SyncReport, WeightSyncError
from xray.sync.coverage import coverage_problem
from xray.sync.weights import check_exact, measured
from xray.transport.wire import manifest_of

pytestmark = pytest.mark.unit
NORM, O_PROJ = "norm.weight", "layers.0.o_proj.weight"


def test_a_check_that_covers_every_tensor_written_passes_with_its_counts_measured():
    sent = model()
    report = sync_through("objstore", sent)
    assert sorted(report["holds"]) == sorted(report["held"]["checked"]) == sorted(n for n, _ in sent)
    totals = check_exact(1, [report, sync_through("objstore", sent)], manifest_of(sent))
    assert (totals["exact"], totals["functional"], totals["unchecked"], totals["holds"]) == (6, 0, 0, 6)
    assert measured(totals) == {"held_exact": 6, "held_functional": 0, "unchecked": 0, "held_tensors": 6}


@pytest.mark.parametrize("engine,fails", [
    (DictEngine(skips=[NORM]), r"1 engine tensor\(s\) written by the sync were never checked \(norm\.weight\): the "
                               r"held check skipped them; teach it their layout"),
    (DictEngine(twice=[O_PROJ]), r"1 check\(s\) counted for tensor\(s\) the sync did not write or wrote once "
                                 r"\(layers\.0\.o_proj\.weight\): the held check counts a tensor twice"),
    (DictEngine(extra=1), r"exact 4 \+ functional 0 \+ unchecked 0 = 4, but the engine holds 3 tensor\(s\) of this "
                          r"sync: its held check counts without naming"),
    (DictEngine(checks=False), r"the engine loaded 3 tensor\(s\) and its held check returned nothing: the backend "
                               r"must check what it holds \(GenerationEngine\.held_check"),
    (DictEngine(says_holds=False), r"the engine does not say which tensors its loads wrote.*implement "
                                   r"GenerationEngine\.held_tensors"),
], ids=["skipped", "counted-twice", "counted-unnamed", "checks-nothing", "holds-unsaid"])
def test_coverage_that_does_not_add_up_fails_the_sync_naming_the_fix(engine, fails):
    sent = model()
    report = sync_through("objstore", sent, engine=engine)
    assert report["changed_in_transit"] == [] and report["held"]["mismatched"] == []  # nothing else is wrong
    with pytest.raises(WeightSyncError, match=r"weight sync to version 1: the held check of rollout replica 0 "
                                              r"does not cover what it holds: " + fails):
        check_exact(1, [report], manifest_of(sent))


def test_the_held_check_names_every_verdict_it_counts():
    check = HeldCheck()
    w = model()[0][1]
    assert check.compare("a", w, w) and check.compare("b", w, w + 1)
    assert not check.compare("c", None, w)  # unreadable: no verdict yet ...
    check.compare_product("c", lambda x: x @ w.t(), 64, w, w.dtype)  # ... until its product is checked
    check.compare_product("d", lambda x: x, 32, w, w.dtype)  # a layout it cannot check
    counts = check.take()
    assert (counts["exact"], counts["functional"], counts["unchecked"], len(counts["mismatched"])) == (1, 1, 1, 1)
    assert counts["checked"] == ["a", "b", "c", "d"] and check.take()["checked"] == []
    report = {"loaded": ["a", "c", "d"], "holds": ["a", "c", "d"], "held": {**counts, "mismatched": []}}
    assert coverage_problem(report).startswith("1 check(s) counted for tensor(s) the sync did not write")  # "b"


def test_held_counts_are_absent_from_the_metrics_when_the_sync_was_not_verified():
    from xray.run.detached.trainer import AsyncTrainer

    verified = SyncReport(3, 10, 0.1, 0.01, float("nan"), held_exact=7, held_functional=8, unchecked=0,
                          held_tensors=15)
    unverified = SyncReport(3, 10, 0.1, 0.0, float("nan"))
    assert verified.counts() == {"sync/held_exact": 7.0, "sync/held_functional": 8.0, "sync/unchecked": 0.0}
    assert unverified.counts() == {} and measured(None) == {}

    def loaded(report) -> dict:  # the asynchronous trainer's report of two makers' loads of one push
        done = concurrent.futures.Future()
        done.set_result((report, 5.0))
        trainer = types.SimpleNamespace(pushes=[{"version": 3, "published": 1.0, "loads": [done, done]}])
        return AsyncTrainer.loaded(trainer)

    assert {k: v for k, v in loaded(verified).items() if k in verified.counts()} == {
        "sync/held_exact": 14.0, "sync/held_functional": 16.0, "sync/unchecked": 0.0}
    metrics = loaded(unverified)
    assert metrics["sync/replicas_loaded"] == 2.0 and not {"sync/held_exact", "sync/unchecked"} & metrics.keys()


def test_the_export_check_fails_the_sync_naming_the_tensor_or_the_rank():
    """The actor's export digest verdict (`xray/sync/export_check.py`): counted when clean; a
    gathered tensor unlike its shards, or a diverged replica, fails the sync with its name."""
    from xray.sync.export_check import check_export

    clean = {"checked": 12, "mismatched": [], "diverged": [], "unchecked": [], "replicas": 2}
    assert check_export(4, clean) == 12 and check_export(4, None) is None
    with pytest.raises(WeightSyncError, match=r"version 4.*1 tensor\(s\).*model.layers.0.mlp.up_proj.weight"):
        check_export(4, {**clean, "mismatched": ["model.layers.0.mlp.up_proj.weight (bit sum differ)"]})
    with pytest.raises(WeightSyncError, match=r"replicas disagree.*rank 3 \(dp_rank 1"):
        check_export(4, {**clean, "diverged": ["rank 3 (dp_rank 1, tp_rank 1) holds lm_head.weight otherwise"]})
    report = SyncReport(3, 10, 0.1, 0.01, float("nan"), **measured({"exact": 1, "functional": 0, "unchecked": 0,
                                                                      "holds": 1}, 12))
    assert report.export_checked == 12 and report.counts()["sync/export_checked"] == 12.0
