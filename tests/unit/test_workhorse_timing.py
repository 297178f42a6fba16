"""The Workhorse's busy-time record (what `benchmarks/ppo_step.py` reads), on the plain class, no Ray."""
import time

import pytest

from xray.config.parallel import ParallelDims
from xray.protocol import fanout_methods
from xray.workhorse.base import Workhorse
from xray.workhorse.busy import covered_seconds

pytestmark = pytest.mark.unit


class Sleeper(Workhorse):
    SELF_TIMED = Workhorse.SELF_TIMED | {"produce"}

    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"

    def produce(self, count: int, work_s: float, wait_s: float) -> int:
        """Busy only while producing items; the waits between them are not model compute."""
        def items():
            for _ in range(count):
                time.sleep(work_s)
                yield 1
        total = 0
        for item in self.timed(items()):
            total += item
            time.sleep(wait_s)
        return total


def make() -> Sleeper:
    return Sleeper("actor", 0, ParallelDims())


def test_call_records_time_inside_the_method_and_busy_time_clears_it():
    w = make()
    t0 = time.time()
    assert w.call("nap", ((0.05,), {})) == "rested"
    assert w.call("nap", ((), {"seconds": 0.02})) == "rested"
    t1 = time.time()
    first = w.call("busy_time", ((), {}))
    assert first["rank"] == 0 and first["role"] == "actor"
    (a0, a1, a_name), (b0, b1, b_name) = first["intervals"]
    assert a_name == b_name == "nap"  # each interval names the method it was spent in
    assert t0 <= a0 < a1 <= b0 < b1 <= t1
    assert 0.05 <= a1 - a0 < 0.05 + 0.3 and 0.02 <= b1 - b0 < 0.02 + 0.3  # slack for a loaded machine
    assert first["busy_s"] == pytest.approx((a1 - a0) + (b1 - b0))
    # drained, and reading it is not itself counted as busy
    assert w.call("busy_time", ((), {})) == {"rank": 0, "role": "actor", "intervals": [], "busy_s": 0.0}


def test_self_timed_method_counts_only_what_it_marks():
    w = make()
    t0 = time.perf_counter()
    assert w.call("produce", ((3, 0.02, 0.1), {})) == 3
    wall = time.perf_counter() - t0
    got = w.busy_time()
    # 3 items of 0.02 s plus the final (empty) next(); the 3 waits of 0.1 s are not busy
    assert len(got["intervals"]) == 4 and {i[2] for i in got["intervals"]} == {"produce"}
    assert 0.06 <= got["busy_s"] < 0.06 + 0.2
    assert wall >= 0.06 + 0.3


def test_record_is_bounded_and_busy_time_is_a_fanout_method():
    w = make()
    for _ in range(Workhorse.MAX_INTERVALS + 5):
        with w.busy():
            pass
    assert len(w.busy_time()["intervals"]) == Workhorse.MAX_INTERVALS
    meta = fanout_methods(Sleeper)["busy_time"]
    assert (meta.dispatch, meta.execute) == ("all", "all")


def test_covered_seconds_counts_overlaps_once_and_clips_to_the_window():
    # two roles busy at once (0-2 and 1-4), then one alone (6-7): 4 + 1 seconds
    intervals = [(6.0, 7.0), (0.0, 2.0), (1.0, 4.0)]
    assert covered_seconds(intervals) == pytest.approx(5.0)
    assert covered_seconds(intervals, 1.5, 6.5) == pytest.approx(2.5 + 0.5)
    assert covered_seconds([(0.0, 3.0), (1.0, 2.0)]) == pytest.approx(3.0)  # nested
    assert covered_seconds(intervals, 4.0, 6.0) == 0.0
    assert covered_seconds([]) == 0.0
