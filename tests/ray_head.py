"""A real Ray head started with `ray start --head` on 127.0.0.1, shared by the end-to-end runs of a
test session (each `python -m xray.train` joins it through `RAY_ADDRESS` instead of starting and
stopping its own cluster, which costs 6-9 s a run on 2 cores) and by the `ray job submit` run of
`tests/e2e/test_learning.py`.

Token authentication is off (`RAY_AUTH_MODE=disabled`): Ray reads its authentication mode once per
process, and the test process's own earlier clusters fix it there, so a test that joins in-process
could not follow a token-protected head (the README's `RAY_AUTH_MODE=token` route was checked by
hand). Every port is chosen free, so that the local clusters other tests start beside it do not
collide with it.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RAY = Path(sys.executable).with_name("ray")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class RayHead:
    """A running head: its GCS address, its job-submission URL and the environment that reaches it."""

    process: subprocess.Popen
    address: str
    dashboard: str
    env: dict[str, str]
    temp_dir: Path

    def stop(self) -> None:
        """Stop every process of the head (`ray start --block` stops its cluster on SIGTERM)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_head(temp_root: Path, num_cpus: int = 16, timeout_s: float = 120.0) -> RayHead:
    """`ray start --head --block` in its own process group; returns once jobs can be submitted."""
    gcs, dash, agent_grpc, agent_http, env_agent, metrics, client = free_ports(7)
    temp_dir = Path(tempfile.mkdtemp(prefix="xh", dir="/tmp"))  # short: Ray's socket paths stay under 107 bytes
    env = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
               f"--num-cpus={num_cpus}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dash}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--dashboard-agent-listen-port={agent_http}", f"--runtime-env-agent-port={env_agent}",
               f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log = open(temp_root / "ray-head.log", "w")
    process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    head = RayHead(process, f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", env, temp_dir)
    atexit.register(head.stop)  # also when the session is interrupted
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"ray start --head exited {process.returncode}: "
                               f"{(temp_root / 'ray-head.log').read_text()[-3000:]}")
        if dashboard_up(head.dashboard):
            return head
        if time.monotonic() > deadline:
            head.stop()
            raise TimeoutError(f"the Ray head's job server did not answer in {timeout_s:.0f} s")
        time.sleep(0.5)


def dashboard_up(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2) as r:
            return r.status in (200, 401)
    except Exception as exc:  # noqa: BLE001 - not up yet
        return getattr(exc, "code", None) == 401
