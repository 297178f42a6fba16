"""The driver's graceful stop (xray/run/graceful.py): a step under way after a signal is given a
grace, fixed (`trainer.exit_grace_s`) or sized to the steps seen (null), then abandoned."""
import asyncio
import signal

import pytest

from xray.run import graceful
from xray.run.graceful import GracefulStop

pytestmark = pytest.mark.unit


async def _guarded(stop: GracefulStop, seconds: float, signal_after: float | None = None):
    if signal_after is not None:
        asyncio.get_running_loop().call_later(signal_after, stop._on_signal, signal.SIGTERM)
    return await stop.guard(asyncio.sleep(seconds, result="done"))


def test_a_fixed_grace_and_abandon():
    assert GracefulStop("finish", 7.0).grace_s == 7.0
    assert GracefulStop("abandon", 7.0).grace_s == 0.0
    stop = GracefulStop("finish", 0.1)
    assert asyncio.run(_guarded(stop, 0.5, signal_after=0.05)) is None and stop.abandoned


def test_the_grace_sized_to_the_steps(monkeypatch):
    stop = GracefulStop("finish", None)
    assert stop.grace_s == graceful.MIN_GRACE_S  # no step seen yet: the floor, 10 s
    monkeypatch.setattr(graceful, "MIN_GRACE_S", 0.0)

    async def run() -> list:
        out = [await _guarded(stop, s) for s in (0.05, 0.2, 0.1)]
        assert stop.grace_s == pytest.approx(1.5 * max(stop.steps_s)) and 0.2 <= max(stop.steps_s) < 0.35
        # a step as long as the longest, signalled in its middle, finishes inside 1.5 x that
        out.append(await _guarded(stop, 0.2, signal_after=0.1))
        assert not stop.abandoned
        out.append(await _guarded(stop, 2.0, signal_after=0.1))  # ten times longer: abandoned
        return out
    assert asyncio.run(run()) == ["done"] * 4 + [None] and stop.abandoned
