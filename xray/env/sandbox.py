"""The Python sandbox: a tool that runs a model's code in a process that cannot hurt the host.

Each call runs the code as `main.py` with this Python (`-I`: isolated from the user's site and
environment) in namespaces of its own, built by the kernel for the call (`xray/env/isolation.py`:
a new root with the system and the Python installation read-only, a private /proc, no network,
an unprivileged uid, no capabilities, no way to make more namespaces). Nothing inside the
program's interpreter guards it: the program may do anything a process may, inside its namespaces.
Limits (`SandboxLimits`): CPU seconds, address space, file size, open files, processes and threads
(kernel rlimits, through `prlimit`), its directory's size (a tmpfs), wall seconds (its pid namespace
is killed, and every process in it with it), and output bytes (past them it is killed and the
observation says so). Nothing of a call outlives it: its processes die with the namespace's
first process, its directory with the mount namespace, and the host keeps only a temporary
directory it never shows the program, removed after the call.

A host that cannot build all of this gets `SandboxUnavailable` at construction, saying what to
allow (user namespaces, a full /proc) or to use a remote sandbox (`xray/env/remote_sandbox.py`),
never a weaker run; a call whose setup fails later raises it too. The host must be Linux with
util-linux (`unshare`, `setpriv`, `prlimit`, `mount`, `pivot_root`); as a user other than root it
must allow unprivileged user namespaces, and as root it must allow new namespaces.

What a call returns (`SandboxResult`) becomes the observation the model reads
(`SandboxResult.observation`): its output, or why it stopped. This file sits beside the tools
and environments that use it (`xray/env/`), below the algorithms that run episodes.
"""
from __future__ import annotations

import asyncio
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from xray.config.sandbox import SandboxLimits
from xray.env import isolation
from xray.env.isolation import READY, SandboxUnavailable

__all__ = ["PythonSandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]

ALLOW = ("if it is user namespaces that this host refuses, allow them: on Debian and Ubuntu "
         "`sysctl kernel.unprivileged_userns_clone=1` and `sysctl kernel.apparmor_restrict_unprivileged_userns=0`, "
         "elsewhere `sysctl user.max_user_namespaces=10000`; in a container, run it with user namespaces allowed "
         "(e.g. Docker's --security-opt seccomp=unconfined and an unmasked /proc); or set env.sandbox.url to a "
         "remote sandbox (SandboxFusion)")
"""What a host that cannot build the sandbox may do about it."""


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


SETUP_S = 60.0
"""Seconds the namespaces' setup may take before the program starts (a loaded host's), beyond which
the call raises."""
_UIDS = random.SystemRandom()
"""Draws a root host's program uids (apart from any seed a run sets)."""
_CHECKED: dict[tuple[str, bool], isolation.Layout] = {}
"""Hosts checked in this process, by (Python, whether the caller is root): their layouts."""


class PythonSandbox:
    """Runs Python code under `limits` (see the module docstring)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable):
        limits.check()
        self.limits, self.python = limits, python
        self.root_host = os.geteuid() == 0
        key = (python, self.root_host)
        lay = _CHECKED.get(key) or isolation.layout(python)
        self.boot = isolation.boot_script(lay, limits, python, self.root_host)
        if key not in _CHECKED:
            self._probe()
            _CHECKED[key] = lay

    def _probe(self) -> None:
        """One empty call, run to its end: every step of the isolation works on this host, or say what to allow."""
        base = self._prepare("")
        read, write = os.pipe()
        try:
            done = subprocess.run(self._command(base), capture_output=True, env=isolation.environment(), stdin=write,
                                  timeout=SETUP_S)
        except subprocess.TimeoutExpired:
            raise SandboxUnavailable(f"the Python sandbox's setup took more than {SETUP_S} s on this host") from None
        finally:
            os.close(write)
            os.close(read)
            shutil.rmtree(base)
        setup = done.stderr.decode(errors="replace")
        if done.returncode != 0 or READY not in setup:
            raise SandboxUnavailable(f"this host cannot build the Python sandbox (exit code {done.returncode}: "
                                     f"{setup.replace(READY, '').strip()[-600:] or 'no message'}); {ALLOW}")

    def _prepare(self, code: str) -> str:
        """The host's directory for one call: `main.py` and an empty `root/` (the new root's mount point)."""
        base = tempfile.mkdtemp(prefix="xray-sandbox-")
        os.mkdir(os.path.join(base, "root"))
        with open(os.path.join(base, "main.py"), "w") as f:
            f.write(code)
        return base

    def _command(self, base: str) -> list[str]:
        uid = _UIDS.randrange(*isolation.PROGRAM_UIDS) if self.root_host else 0
        return isolation.command(self.boot, base, uid, self.root_host)

    async def run(self, code: str) -> SandboxResult:
        """Run `code` (a Python program) and return how it ended. Cancelled (a caller's timeout),
        it kills the sandbox before it lets the cancellation through."""
        base = self._prepare(code)
        read, write = os.pipe()  # the program's stderr: the chain's stdin until its shell moves it (isolation.py)
        transport = None
        try:
            program_err = asyncio.StreamReader()
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(program_err), os.fdopen(read, "rb", 0))
            proc = await asyncio.create_subprocess_exec(
                *self._command(base), stdin=write, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=isolation.environment(), start_new_session=True)
            os.close(write)
            write = -1
            try:
                return await self._watch(proc, program_err)
            except BaseException:
                await _kill(proc)  # the signal goes before the first wait: a second cancellation still kills
                raise
        finally:
            if write >= 0:
                os.close(write)
            if transport is not None:
                transport.close()
            shutil.rmtree(base)

    def run_sync(self, code: str) -> SandboxResult:
        """`run` from blocking code."""
        return asyncio.run(self.run(code))

    async def _watch(self, proc: asyncio.subprocess.Process, program_err: asyncio.StreamReader) -> SandboxResult:
        """Collect the output under the output and wall limits (the wall clock starts with the
        program, at `READY`: a slow host's setup is not the program's time); kill the sandbox past
        either, or when its setup takes more than `SETUP_S`."""
        out = _Output(self.limits.output_bytes)
        pumps = asyncio.gather(out.pump("stdout", proc.stdout), out.pump("stderr", program_err),
                               out.pump("setup", proc.stderr))
        pumps.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled call leaves no warning
        exited, ready = asyncio.ensure_future(proc.wait()), asyncio.ensure_future(out.ready.wait())
        stopper = asyncio.ensure_future(out.over.wait())
        try:
            await asyncio.wait({exited, ready}, timeout=SETUP_S, return_when=asyncio.FIRST_COMPLETED)
            reason = None if out.ready.is_set() or exited.done() else "setup"
            if reason is None:
                done, _ = await asyncio.wait({exited, stopper}, timeout=self.limits.wall_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                reason = "output" if out.over.is_set() else ("timeout" if not done else None)
            if reason is not None:
                await _kill(proc)
        finally:
            ready.cancel()
            stopper.cancel()
        code = await proc.wait()
        try:  # the pipes close with the processes: what is left in them comes in
            await asyncio.wait_for(pumps, 5.0)
        except asyncio.TimeoutError:
            pumps.cancel()
        if not out.ready.is_set():
            setup = out.setup.decode(errors="replace").strip()[-600:] or "no message"
            raise SandboxUnavailable(f"the Python sandbox could not be set up for this call "
                                     f"({f'more than {SETUP_S} s' if reason == 'setup' else f'exit code {code}'}: "
                                     f"{setup}); {ALLOW}")
        if reason is None:
            reason = "ok" if code == 0 else "cpu" if code == 128 + signal.SIGXCPU else "error"
        return SandboxResult(out.text("stdout"), out.text("stderr"), None if reason in ("output", "timeout") else code,
                             reason)


class _Output:
    """A call's stdout and stderr, cut to `budget` bytes together, and what the setup wrote (its
    end: its errors, or `READY`, then what `unshare` says of a killed sandbox)."""

    def __init__(self, budget: int):
        self.budget, self.setup = budget, b""
        self.chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.over, self.ready = asyncio.Event(), asyncio.Event()

    async def pump(self, name: str, stream: asyncio.StreamReader) -> None:
        while data := await stream.read(65536):  # to the end: a pipe left unread would keep wait() waiting
            if name == "setup":
                self.setup = (self.setup + data)[-65536:]
                if READY.encode() in self.setup:
                    self.ready.set()
                continue
            self.chunks[name].append(data[:max(self.budget, 0)])
            self.budget -= len(data)
            if self.budget < 0:
                self.over.set()

    def text(self, name: str) -> str:
        return b"".join(self.chunks[name]).decode(errors="replace")


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the sandbox's pid 1 (`unshare`'s child): the kernel kills every process of its pid
    namespace before it ends, and `unshare` ends once it has, so that nothing of the call is left
    when this returns. Before `unshare` has forked, or if it does not end, its session is killed."""
    init = _child(proc.pid)
    if init is not None:
        _signal(init, os.kill)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), 10.0)
            return
        except asyncio.TimeoutError:
            pass
    _signal(proc.pid, os.killpg)


def _signal(pid: int, kill) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child(pid: int) -> int | None:
    """A child of `pid`, if it has one (from /proc: `children` where the kernel has it, else every `stat`)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        return int(children[0]) if children else None
    except OSError:
        pass
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and int(fields[1]) == pid:
            return int(path.split("/")[2])
    return None
