"""The Python sandbox (`xray/env/sandbox.py`): hostile programs end as clear observations within the
limits, and the host is left as it was (no stray process, no file, no connection)."""
import glob
import os
import socket
import time
import uuid

import pytest

from xray.env.sandbox import PythonSandbox, SandboxLimits

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(cpu_s=2, wall_s=5.0, memory_mb=512, processes=16, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(LIMITS)


def sandboxed_processes() -> list[int]:
    """Pids of processes still running a sandboxed program (`python -I -c GUARD`)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            args = open(path, "rb").read().split(b"\0")
        except OSError:
            continue
        if args[1:3] == [b"-I", b"-c"] and b"main.py" in args[3]:
            found.append(int(path.split("/")[2]))
    return found


def leftovers() -> list[str]:
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), "xray-sandbox-*"))


def run(sandbox, code: str):
    t0 = time.monotonic()
    result = sandbox.run_sync(code)
    return result, time.monotonic() - t0


def test_ordinary_code_runs_and_writes_in_its_own_directory(sandbox):
    result, _ = run(sandbox, "open('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), 2 + 3)")
    assert (result.reason, result.exit_code, result.stdout) == ("ok", 0, "hi 5\n")
    assert result.observation() == "hi 5"
    error, _ = run(sandbox, "raise ValueError('bad input')")
    assert error.reason == "error" and error.exit_code == 1
    assert "ValueError: bad input" in error.observation() and error.observation().endswith("[exit code 1]")


@pytest.mark.parametrize("name, code, reasons, says", [
    ("infinite loop", "while True:\n    pass", {"cpu", "timeout"}, "limit"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", {"error"}, "os.fork is not available in the sandbox"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])", {"error"}, "not available"),
    ("ctypes fork", "import ctypes\nctypes.CDLL(None).fork()", {"error"}, "not available in the sandbox"),
    ("10 GB allocation", "x = bytearray(10 * 2**30)", {"error"}, "MemoryError"),
    ("100 MB of output", "import sys\nsys.stdout.write('x' * 100_000_000)", {"output"}, "output limit"),
])
def test_a_hostile_program_ends_within_the_limits_and_leaves_nothing(sandbox, name, code, reasons, says):
    before = set(leftovers())  # another run's, if any
    result, elapsed = run(sandbox, code)
    assert result.reason in reasons, (name, result)
    assert says in result.observation(), (name, result.observation()[-500:])
    assert elapsed < LIMITS.wall_s + 3.0, (name, elapsed)
    assert len(result.stdout) + len(result.stderr) <= LIMITS.output_bytes
    time.sleep(0.2)
    assert sandboxed_processes() == [], name
    assert set(leftovers()) <= before, name


def test_nothing_outside_its_directory_is_writable(sandbox, tmp_path):
    outside = [str(tmp_path / "escape.txt"), f"/tmp/xray-escape-{uuid.uuid4().hex}", "/dev/shm/xray-escape"]
    code = "\n".join(f"try:\n    open({p!r}, 'w').write('x')\n    print('wrote', {p!r})\n"
                     f"except OSError as e:\n    print('refused', e.strerror)" for p in outside)
    result, _ = run(sandbox, code)
    assert result.reason == "ok" and "wrote" not in result.stdout, result
    assert result.stdout.count("refused Read-only file system") == len(outside), result.stdout
    assert not any(os.path.exists(p) for p in outside)


def test_no_network(sandbox):
    """A listener on the host's loopback: the sandboxed program cannot reach it (its namespace has
    no interface up) and no connection arrives."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError as e:\n    print('failed', e.strerror)\n"
            "try:\n    socket.getaddrinfo('pypi.org', 443)\n    print('resolved')\n"
            "except OSError as e:\n    print('no dns')")
    result, _ = run(sandbox, code)
    assert result.reason == "ok" and "connected" not in result.stdout and "resolved" not in result.stdout, result
    assert "failed" in result.stdout and "no dns" in result.stdout
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()
