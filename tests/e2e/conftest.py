"""End-to-end tier: every run joins one Ray head shared by the session (`tests/ray_head.py`), started
before the first e2e test and stopped after the last one, so the runs skip starting a cluster each.
A test that drives runs in this process stays connected to the head until then (joining again in
one process after `ray.shutdown()` costs about 30 s here). Every e2e test also shares one cache
directory (`XRAY_CACHE`), so the built-in model is warm-started once a session, by whichever run
needs it first (`test_learning.py`), not read from a cache outside the session."""
from __future__ import annotations

import pytest

from tests.ray_head import RayHead, start_head

_HEAD: list[RayHead] = []


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory) -> RayHead:
    if not _HEAD:
        _HEAD.append(start_head(tmp_path_factory.mktemp("rayhead", numbered=False)))
    return _HEAD[0]


@pytest.fixture(scope="session")
def xray_cache(tmp_path_factory):
    """The session's cache of built-in models (`XRAY_CACHE`: `algorithms.warm_start`)."""
    return tmp_path_factory.mktemp("xray-cache")


@pytest.fixture(autouse=True)
def join_shared_head(ray_head: RayHead, xray_cache, monkeypatch):
    """`python -m xray.train` run by the test joins the shared head (it reads RAY_ADDRESS) and
    uses the session's cache."""
    for key, value in ray_head.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_ADDRESS", ray_head.address)
    monkeypatch.setenv("XRAY_CACHE", str(xray_cache))


def pytest_runtest_teardown(item, nextitem):
    """Stop the head once no e2e test follows: the tiers after this one start their own clusters."""
    if _HEAD and (nextitem is None or nextitem.path.parent != item.path.parent):
        import ray

        ray.shutdown()  # this process's own connection, if a test made one
        _HEAD.pop().stop()
