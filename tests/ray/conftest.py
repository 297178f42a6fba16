"""Ray-tier fixtures: one local cluster on 127.0.0.1 shared by the modules that drive Ray in this
process, and one `ray start --head` shared by the modules whose commands and notebook kernels join
a cluster of their own.

Starting a local cluster and shutting it down costs 6-9 s on 2 cores, so `local_ray` starts one
only when none is running, and keeps it for the modules after: the in-process modules share it
until a module that needs its own nodes (`ray.cluster_utils.Cluster`: test_elastic,
test_multinode) shuts it down, and the next `local_ray` starts a new one. The session's end shuts
the last one down. Child processes (`python -m xray.check`, the example notebooks' kernels) join
`subprocess_head` through `RAY_ADDRESS` instead of starting a cluster each (`tests/ray_head.py`).
"""
import os

import pytest

from tests.ray_head import RayHead, start_head

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

_HEAD: list[RayHead] = []


@pytest.fixture(scope="session")
def _local_ray_at_end():
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(_local_ray_at_end):
    """A local cluster for this module (the running one, if a module before left it up)."""
    from xray.wholemodel.cluster import ensure_ray

    ensure_ray()


@pytest.fixture(scope="session")
def _subprocess_head(tmp_path_factory) -> RayHead:
    if not _HEAD:
        _HEAD.append(start_head(tmp_path_factory.mktemp("ray-tier-head", numbered=False)))
    yield _HEAD[0]
    _HEAD.pop().stop()


@pytest.fixture
def subprocess_head(_subprocess_head: RayHead, monkeypatch) -> RayHead:
    """The tier's shared head: commands this test starts, and kernels, join it (`RAY_ADDRESS`)."""
    for key, value in _subprocess_head.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RAY_ADDRESS", _subprocess_head.address)
    return _subprocess_head
