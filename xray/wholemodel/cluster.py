"""Joining or starting the Ray cluster that WholeModels run on.

`--ray-address` (or `RAY_ADDRESS`) joins an existing cluster; otherwise a local one is started (a
new one, even where another cluster runs on this machine), bound to 127.0.0.1, with the dashboard
and Ray's metrics off unless asked for (their agent, after a node's death, took a core for ~12 s:
`benchmarks/fault_injection.py`). On a CPU machine a "device" is one Workhorse process with a fixed number of
torch threads, so the local cluster offers at least `MIN_LOCAL_CPU_SLOTS` CPU slots: Ray counts
slots, the OS shares the cores.

The job carries no runtime environment: a worker started for a job with one goes through Ray's
setup process first (about 0.6 s of CPU a worker: every WholeModel actor, inbox and holder of a
run). A local cluster's processes inherit `PYTHONUNBUFFERED` from this one instead; Workhorses
set it in their own environment (`xray.workhorse.quiet.WORKHORSE_ENV`), so their prints reach the
console as they are made on any cluster.
"""
from __future__ import annotations

import logging
import os

from xray.workhorse.quiet import quiet_driver

log = logging.getLogger(__name__)
MIN_LOCAL_CPU_SLOTS = 16


def ensure_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = False) -> None:
    """Connect to `address` / $RAY_ADDRESS, or start a local cluster; no-op if already connected."""
    import ray

    if ray.is_initialized():
        return
    quiet_driver()  # Ray's and DeepSpeed's start-up notices (xray.workhorse.quiet), in notebooks too
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    bind_loopback()
    slots = max(num_cpus or 0, os.cpu_count() or 1, MIN_LOCAL_CPU_SLOTS)
    log.info("starting a local Ray cluster on 127.0.0.1 with %d CPU slots", slots)
    # address="local": a new cluster, as documented, even where another runs on this machine (without
    # an address, Ray joins any cluster whose GCS it finds running here)
    os.environ["PYTHONUNBUFFERED"] = "1"  # the cluster's processes inherit it (no runtime environment)
    ray.init(address="local", num_cpus=slots, include_dashboard=dashboard, log_to_driver=True,
             configure_logging=False, _system_config={"enable_metrics_collection": dashboard})


def bind_loopback() -> None:
    """Make a cluster started from this process use 127.0.0.1 for every node and worker.

    Ray turns a `_node_ip_address` of 127.0.0.1 into the machine's reachable address; its
    single-machine mode (the switch below, read when Ray resolves addresses and inherited by the
    processes it starts) keeps everything on loopback instead.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
