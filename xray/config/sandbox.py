"""The `env.sandbox` section of a run config: where the `builtin:python` tool runs a model's program,
and what one call may use.

Sits in the config layer. The local sandbox (`xray/env/sandbox.py`) reads `SandboxLimits` as kernel
limits; the remote one (`xray/env/remote_sandbox.py`, chosen by `url`) sends the wall limit to the
service and cuts the output to `output_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. A forked process gets the per-process limits afresh (CPU seconds,
    address space), so a program uses at most `processes x memory_mb` of memory in all."""

    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU): past them it is stopped (reason `cpu`)."""
    wall_s: float = 10.0
    """Wall seconds from the program's start: past them its whole pid namespace is killed (reason `timeout`)."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS): an allocation past it fails (a Python MemoryError)."""
    file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE): a longer write fails (`File too large`)."""
    disk_mb: int = 64
    """Its directory's size (a private tmpfs, in memory): past it writes fail (`No space left`)."""
    processes: int = 16
    """Processes and threads at once, its shell included (RLIMIT_NPROC: counted in the program's own
    user namespace, for a uid that is never root on the host, so that it holds on a root host too)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 16 * 1024
    """stdout and stderr together: past them the process is killed and the rest dropped (reason `output`)."""

    def check(self, where: str = "SandboxLimits.") -> None:
        """Raise ValueError on a limit that cannot work, saying the fix (`where`: the limits' path)."""
        for name in ("cpu_s", "memory_mb", "file_mb", "disk_mb", "open_files", "output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{where}{name}={getattr(self, name)}; give 1 or more")
        if self.processes < 2:
            raise ValueError(f"{where}processes={self.processes}; give 2 or more (its shell and Python)")
        if self.wall_s <= 0:
            raise ValueError(f"{where}wall_s={self.wall_s}; give a positive number of seconds")
        if self.open_files < 16:
            raise ValueError(f"{where}open_files={self.open_files}; Python needs 16 or more to start")


@dataclass(frozen=True)
class SandboxConfig:
    """Where `builtin:python` runs a model's program (local Linux namespaces, or a remote service)."""

    url: Optional[str] = None
    """A remote execution service that speaks SandboxFusion's HTTP API (`POST {url}/run_code`),
    for hosts that cannot make user namespaces (most containers); null: run locally, in Linux
    namespaces (the host must allow them: docs/agents.md)."""
    request_timeout_s: float = 30.0
    """Remote only: seconds an answer may take beyond `limits.wall_s` (the service's queue, the
    network) before the call fails."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """What one call may use."""

    def check(self) -> None:
        """Raise ValueError on settings that cannot work, saying the fix."""
        self.limits.check("env.sandbox.limits.")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"env.sandbox.url={self.url!r}; give the service's address, as http://host:port")
        if self.request_timeout_s <= 0:
            raise ValueError(f"env.sandbox.request_timeout_s={self.request_timeout_s}; give a positive number")
