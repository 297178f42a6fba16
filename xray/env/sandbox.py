"""The Python sandbox: a tool that runs a model's code in a process that cannot hurt the host.

Each call writes the code to a fresh temporary directory and runs it with this Python (`-I`:
isolated from the user's site and environment; an audit hook, `GUARD`, refuses new processes and
`ctypes`) inside Linux namespaces made by `unshare`:
- a user namespace (its root maps to the caller: no privilege outside it);
- a network namespace with no interface up: any connection fails at once;
- a mount namespace in which every mount is read-only except the call's own directory (its
  working directory, `HOME` and `TMPDIR`);
- a pid namespace whose first process is killed with the call: nothing it started outlives it.
Limits (`SandboxLimits`): CPU seconds and address space, file size and process count (kernel
rlimits, through `prlimit`), wall seconds (the whole namespace is killed), and output bytes (the
process is killed once its stdout and stderr together pass the limit, and the observation says so).
The directory is removed after the call. A machine without user namespaces gets a clear error at
construction, never an unsandboxed run.

What a call returns (`SandboxResult`) becomes the observation the model reads
(`SandboxResult.observation`): its output, or why it stopped. This file sits beside the tools
and environments that use it (`xray/env/`), below the algorithms that run episodes.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

BOOT = r"""
set -e
awk '{print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
mount --bind "$1" "$1"
mount -o remount,bind,rw "$1"
cd "$1"
shift
"$@"
exit $?
"""
"""Run inside the namespaces (as their first process): every mount read-only, then the call's
directory writable again; the program runs as its child, and a death by signal comes back as the
exit code 128 + signal (unshare cannot pass SIGXCPU on)."""

GUARD = r"""
import sys
_DENIED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "pty.spawn"}
_MODULES = {"_posixsubprocess", "_ctypes", "ctypes"}
def _guard(event, args):
    if event in _DENIED or (event == "import" and args[0] in _MODULES):
        name = args[0] if event == "import" else event
        raise PermissionError(f"{name} is not available in the sandbox (no new processes, no foreign calls)")
sys.addaudithook(_guard)
del _guard
__name__ = "__main__"
exec(compile(open("main.py").read(), "main.py", "exec"))
"""
"""The program's prelude: an audit hook (it cannot be removed) refuses new processes and foreign
calls, so a fork bomb ends at its first fork; then main.py runs as `__main__`."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot make the namespaces the sandbox needs."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use."""

    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU): past them the process is killed (reason `cpu`)."""
    wall_s: float = 10.0
    """Wall seconds: past them the whole namespace is killed (reason `timeout`)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS): an allocation past it fails (a Python MemoryError)."""
    file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE)."""
    processes: int = 32
    """Processes and threads it may run at once (RLIMIT_NPROC, counted in its own user namespace)."""
    output_bytes: int = 16 * 1024
    """stdout and stderr together: past them the process is killed and the rest dropped (reason `output`)."""


@dataclass(frozen=True)
class SandboxResult:
    """One call's end: its output (cut to the limit), exit code (None when killed) and why it ended:
    `ok`, `error` (a non-zero exit), `cpu`, `timeout` or `output`."""

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str

    def observation(self) -> str:
        """The text the model reads back."""
        why = {"ok": "", "error": f"[exit code {self.exit_code}]",
               "cpu": "[stopped: CPU time limit]", "timeout": "[stopped: wall time limit]",
               "output": "[stopped: output limit]"}[self.reason]
        parts = [self.stdout.rstrip("\n"), self.stderr.rstrip("\n"), why]
        return "\n".join(p for p in parts if p)


class PythonSandbox:
    """Runs Python code under `limits` (see the module docstring)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
        self.limits, self.python = limits, python
        for tool in ("unshare", "prlimit"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"the Python sandbox needs `{tool}` (util-linux); install it "
                                         "(Debian: apt-get install util-linux)")
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
                                "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise SandboxUnavailable("the Python sandbox needs Linux user namespaces, and `unshare --user` "
                                     f"failed here ({probe.stderr.strip()}); allow them (sysctl "
                                     "kernel.unprivileged_userns_clone=1, or the distribution's AppArmor setting)")

    def command(self, directory: str) -> list[str]:
        lim = self.limits
        return ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child", "--",
                "prlimit", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb << 20}", f"--fsize={lim.file_mb << 20}",
                f"--nproc={lim.processes}", "--", "sh", "-c", BOOT, "sandbox", directory,
                self.python, "-I", "-c", GUARD]

    async def run(self, code: str) -> SandboxResult:
        """Run `code` (a Python program) and return how it ended."""
        directory = tempfile.mkdtemp(prefix="xray-sandbox-")
        try:
            with open(os.path.join(directory, "main.py"), "w") as f:
                f.write(code)
            env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8"}
            proc = await asyncio.create_subprocess_exec(
                *self.command(directory), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
            return await self._watch(proc)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def run_sync(self, code: str) -> SandboxResult:
        """`run` from blocking code."""
        return asyncio.run(self.run(code))

    async def _watch(self, proc: asyncio.subprocess.Process) -> SandboxResult:
        """Collect the output under the output and wall limits; kill the session past either."""
        budget = [self.limits.output_bytes]
        chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        over = asyncio.Event()

        async def pump(name: str, stream: asyncio.StreamReader) -> None:
            while data := await stream.read(65536):  # to the end: a pipe left unread would keep wait() waiting
                keep = data[:max(budget[0], 0)]
                chunks[name].append(keep)
                budget[0] -= len(data)
                if budget[0] < 0:
                    over.set()

        pumps = asyncio.gather(pump("stdout", proc.stdout), pump("stderr", proc.stderr))
        stopper = asyncio.ensure_future(over.wait())
        done, _ = await asyncio.wait({asyncio.ensure_future(proc.wait()), stopper},
                                     timeout=self.limits.wall_s, return_when=asyncio.FIRST_COMPLETED)
        reason = "output" if over.is_set() else ("timeout" if not done else None)
        if reason is not None:
            _kill(proc)
        stopper.cancel()
        code = await proc.wait()
        try:  # the pipes close with the process: what is left in them comes in
            await asyncio.wait_for(pumps, 5.0)
        except asyncio.TimeoutError:
            pumps.cancel()
        out = b"".join(chunks["stdout"]).decode(errors="replace")
        err = b"".join(chunks["stderr"]).decode(errors="replace")
        if reason is None:
            reason = "ok" if code == 0 else "cpu" if code == 128 + signal.SIGXCPU else "error"
        return SandboxResult(out, err, None if reason in ("output", "timeout") else code, reason)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the call's session (unshare and, through --kill-child, its whole pid namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
