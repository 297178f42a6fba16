"""Ray-tier fixtures: a local cluster on 127.0.0.1, shut down after each module."""
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on loopback
os.environ.setdefault("RAY_DEDUP_LOGS", "1")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    from xray.wholemodel.cluster import ensure_ray

    ensure_ray()
    yield
    ray.shutdown()
