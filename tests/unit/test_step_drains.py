"""The rule a synchronous run uses to wait for a step or abort it on a drain notice
(`xray/run/recovery/midstep.py`, `StepDrains.abort_now`): the step is waited for when its expected
rest is at most half the grace, aborted when longer, and waited for before any step's duration is
known. The whole path (abort, replace, restore, the step run again) runs in
`tests/ray/test_recovery.py::test_dead_workhorses_are_replaced[deepspeed-dsinfer-critic]`."""
from xray.run.recovery.midstep import SAFE_SHARE, StepDrains


def drains(grace_s: float, *steps_s: float) -> StepDrains:
    d = StepDrains(inbox=None, grace_s=grace_s)
    d.steps_s.extend(steps_s)
    return d


def test_waits_before_any_estimate():
    assert drains(0.8).expected_s() is None and not drains(0.8).abort_now(0.2)


def test_expected_is_the_longest_of_the_last_steps():
    d = drains(0.8, 0.5, 0.9, 0.6, 0.6, 0.6, 0.6)  # only the last five count: 0.5 fell out
    assert d.expected_s() == 0.9
    d.steps_s.extend([0.6])  # and now 0.9 did
    assert d.expected_s() == 0.6


def test_a_rest_within_half_the_grace_is_waited_for_a_longer_one_aborted():
    assert SAFE_SHARE == 0.5
    # the CI host's case: a 0.6 s step, the notice read 0.2 s in, a 0.8 s grace: 0.4 s left, waited for
    assert not drains(0.8, 0.6).abort_now(0.2)
    assert drains(0.8, 0.61).abort_now(0.2)  # 0.41 s left of a 0.4 s half-grace: aborted
    assert drains(0.8, 1.1).abort_now(0.4) and not drains(30.0, 1.1).abort_now(0.4)  # a real grace: waited for
    assert drains(30.0, 120.0).abort_now(1.0)  # a two-minute step against a 30 s notice: aborted
