"""End-to-end tier: every run joins one Ray head shared by the session (`tests/ray_head.py`), started
before the first e2e test and stopped after the last one, so the runs skip starting a cluster each.
A test that drives runs in this process stays connected to the head until then (joining again in
one process after `ray.shutdown()` costs about 30 s here)."""
from __future__ import annotations

import pytest

from tests.ray_head import RayHead, start_head

_HEAD: list[RayHead] = []


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory) -> RayHead:
    if not _HEAD:
        _HEAD.append(start_head(tmp_path_factory.mktemp("rayhead", numbered=False)))
    return _HEAD[0]


@pytest.fixture(autouse=True)
def join_shared_head(ray_head: RayHead, monkeypatch):
    """`python -m xray.train` run by the test joins the shared head (it reads RAY_ADDRESS)."""
    for key, value in ray_head.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_ADDRESS", ray_head.address)


def pytest_runtest_teardown(item, nextitem):
    """Stop the head once no e2e test follows: the tiers after this one start their own clusters."""
    if _HEAD and (nextitem is None or nextitem.path.parent != item.path.parent):
        import ray

        ray.shutdown()  # this process's own connection, if a test made one
        _HEAD.pop().stop()
