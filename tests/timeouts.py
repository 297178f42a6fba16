"""Per-test timeouts that end a hung test with the stack of the call it waits in, and go on with the
next test (a pytest plugin, loaded by `tests/conftest.py`).

pytest-timeout sets the limits (`timeout` in pyproject.toml for every test, `@pytest.mark.timeout(s)`
on the longer ones) and its SIGALRM timer; this plugin takes over what happens when it fires:
- In the test process, pytest-timeout's own `pytest.fail` from a signal handler does not stop a
  `ray.get`: Ray's wait checks signals but gives up only on a KeyboardInterrupt, and went on
  waiting (100 s for a task that slept 100 s, measured). The handler here prints the other
  threads' stacks, then raises `TestTimeout`, a KeyboardInterrupt, which ends `ray.get` within its
  signal-check period (0.3 s measured) as well as any plain wait; the hooks below turn it into this
  test's failure, whose traceback shows the call the test waited in, instead of the end of the
  session that a KeyboardInterrupt means to pytest.
- Most end-to-end tests wait on a child command (`python -m xray.train`, `xray.check`), whose stack
  is the one that matters. When the timer fires while such a child runs, the child gets SIGABRT
  first: every child runs with `PYTHONFAULTHANDLER=1` (set below), so it prints every thread's
  stack to its stderr and dies, and the test fails on the child's exit with that stderr in its
  message. If the test has not failed `GRACE_S` seconds later, the handler above fails it.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

GRACE_S = 60.0
"""After a child's stack dump, how long the test has to fail on the child's exit."""
COMMANDS = ("xray.train", "xray.check")
"""Child commands whose stacks are dumped on a timeout (`python -m <command>`)."""

os.environ["PYTHONFAULTHANDLER"] = "1"  # children print every thread's stack on SIGABRT


class TestTimeout(KeyboardInterrupt):
    """Raised in the test by the timer: a KeyboardInterrupt, the one exception `ray.get` stops for."""

    __test__ = False  # not a test class


def hung_children() -> list:
    """This process's direct children that run an xray command (not Ray's own processes)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if any(arg in COMMANDS for arg in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def _interrupt(item, settings) -> None:
    from pytest_timeout import dump_stacks

    terminal = item.config.get_terminal_writer()
    terminal.sep("+", title=f"Timeout ({settings.timeout:g} s): the other threads' stacks")
    dump_stacks(terminal)
    item.timed_out = settings.timeout
    raise TestTimeout(f"the test ran past its timeout of {settings.timeout:g} s")


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's signal timer, with the handlers described above."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer

    def fail(signum, frame):
        _interrupt(item, settings)

    def dump_children(signum, frame):
        children = hung_children()
        if not children:
            _interrupt(item, settings)
        for child in children:
            item.config.get_terminal_writer().line(
                f"\ntimeout ({settings.timeout:g} s): SIGABRT to pid {child.pid} ({' '.join(child.cmdline()[:5])}),"
                " which prints its threads' stacks to its stderr")
            try:
                child.send_signal(signal.SIGABRT)
            except OSError:
                pass
        signal.signal(signal.SIGALRM, fail)
        signal.setitimer(signal.ITIMER_REAL, GRACE_S)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, dump_children)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


def _as_failure(item):
    """Run one phase of a test; a KeyboardInterrupt that the timer caused becomes its failure."""
    try:
        return (yield)
    except KeyboardInterrupt:  # TestTimeout, or the plain one `ray.get` raises for it
        limit = getattr(item, "timed_out", None)
        if limit is None:
            raise  # a real Ctrl-C: stop the session
        item.timed_out = None
        pytest.fail(f"Timeout: the test ran past {limit:g} s; the traceback above shows where it waited")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _as_failure(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _as_failure(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _as_failure(item))
