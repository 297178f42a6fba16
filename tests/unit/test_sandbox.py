"""The Python sandbox (`xray/env/sandbox.py`) against programs that know how it is built. Each attack
runs through `PythonSandbox` itself; each test then checks the HOST: no file written outside, no
connection on the test's listeners, the test's processes alive, no process or directory left.
The remote option (`xray/env/remote_sandbox.py`) is checked against a local HTTP service that speaks
SandboxFusion's API by running the code in a PythonSandbox (the stand-in for a remote service)."""
import asyncio
import dataclasses
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from xray.config.sandbox import SandboxConfig, SandboxLimits
from xray.env.remote_sandbox import RemoteSandbox, RemoteSandboxError
from xray.env.sandbox import PythonSandbox, SandboxUnavailable

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(cpu_s=1, wall_s=4.0, memory_mb=128, file_mb=1, disk_mb=4, processes=8, open_files=32,
                       output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(LIMITS)


def _foreign_processes() -> set[int]:
    """Pids of processes in a pid namespace other than the test's own."""
    own, found = os.readlink("/proc/self/ns/pid"), set()
    for path in glob.glob("/proc/[0-9]*/ns/pid"):
        try:
            if os.readlink(path) != own:
                found.add(int(path.split("/")[2]))
        except OSError:
            continue
    return found


def _leftovers() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "xray-sandbox-*")))


@pytest.fixture
def host():
    """After the attack: no process of the sandbox's namespaces and no directory of its call left."""
    processes, dirs = _foreign_processes(), _leftovers()
    yield
    assert _foreign_processes() - processes == set()
    assert _leftovers() <= dirs


def run(sandbox, code: str):
    t0 = time.monotonic()
    result = sandbox.run_sync(code)
    return result, time.monotonic() - t0


def lines(result, prefix: str) -> list[list[str]]:
    return [line.split()[1:] for line in result.stdout.splitlines() if line.startswith(prefix + " ")]


def test_ordinary_code_runs_in_its_own_directory(sandbox, host):
    code = "import os\nopen('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), 2 + 3, os.getcwd())"
    result, _ = run(sandbox, code)
    assert (result.reason, result.exit_code, result.stdout) == ("ok", 0, "hi 5 /sandbox\n")
    assert result.observation() == "hi 5 /sandbox"
    error, _ = run(sandbox, "raise ValueError('bad input')")
    assert error.reason == "error" and error.exit_code == 1
    assert "ValueError: bad input" in error.observation() and error.observation().endswith("[exit code 1]")


def test_no_privilege_and_no_guard_to_switch_off(sandbox, host, tmp_path):
    """The old guard's deny-lists lived in the program's globals; clearing every set there now
    switches nothing off. The program is uid 1000 without a capability; it cannot remount `/`,
    mount anything, or make a user namespace to become root in."""
    target = tmp_path / "escape.txt"
    code = f"""
import gc, os, subprocess
for o in gc.get_objects():
    if type(o) is set:
        o.clear()
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
print("ids", os.getuid(), os.geteuid(), os.getgid(), len(os.getgroups()))
caps = ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb", "NoNewPrivs")
print("caps", *(status[k].strip() for k in caps))
for cmd in (["mount", "-o", "remount,rw", "/"], ["mount", "-t", "tmpfs", "x", "/usr"], ["unshare", "-r", "true"],
            ["unshare", "-rm", "mount", "-o", "remount,rw", "/"], ["sh", "-c", "echo x > {target}"]):
    print("cmd", subprocess.run(cmd, capture_output=True).returncode, *cmd[:2])
try:
    open({str(target)!r}, "w").write("x")
    print("wrote")
except OSError as e:
    print("refused", e.strerror)
"""
    result, _ = run(sandbox, code)
    assert result.reason == "ok", result
    assert lines(result, "ids") == [["1000", "1000", "1000", "0"]]
    assert lines(result, "caps") == [["0000000000000000"] * 5 + ["1"]], result.stdout
    assert len(lines(result, "cmd")) == 5 and all(rc != "0" for rc, *_ in lines(result, "cmd")), result.stdout
    assert "wrote" not in result.stdout and not target.exists()


def test_proc_shows_only_the_sandbox(sandbox, host):
    """A host process with a secret in its environment: no /proc entry of the sandbox shows it, nor
    the test's own command line; the sandbox's /proc holds its own few processes only."""
    secret = uuid.uuid4().hex
    sleeper = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], "XRAY_SECRET": secret})
    code = f"""
import glob, os
print("pids", *sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for pid in (1, {sleeper.pid}, {os.getpid()}):
    for what in ("environ", "cmdline"):
        try:
            print(pid, what, open(f"/proc/{{pid}}/{{what}}", "rb").read())
        except OSError as e:
            print(pid, what, e.strerror)
print("found", sum({secret!r}.encode() in open(p, "rb").read() for p in glob.glob("/proc/[0-9]*/environ")))
"""
    try:
        result, _ = run(sandbox, code)
    finally:
        sleeper.kill()
    assert result.reason == "ok", result
    pids = [int(p) for p in lines(result, "pids")[0]]
    assert pids[0] == 1 and len(pids) == 2 and sleeper.pid not in pids, pids
    assert secret not in result.stdout and "pytest" not in result.stdout and lines(result, "found") == [["0"]]


def test_no_socket_of_the_host_is_reachable(sandbox, host, tmp_path):
    """Listeners on the host: TCP on loopback, unix sockets in the test's tmp dir and under /tmp, an
    abstract one. The program reaches none, and none gets a connection."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    paths = [str(tmp_path / "s.sock"), f"/tmp/xray-test-{uuid.uuid4().hex[:12]}.sock"]
    addresses = [("AF_INET", tcp.getsockname())] + [("AF_UNIX", p) for p in paths]
    addresses.append(("AF_UNIX", f"\0xray-test-{uuid.uuid4().hex[:12]}"))
    servers = [tcp]
    for _, address in addresses[1:]:
        servers.append(socket.socket(socket.AF_UNIX))
        servers[-1].bind(address)
    for server in servers:
        server.listen()
        server.setblocking(False)
    code = f"""
import socket
for family, address in {addresses!r}:
    s = socket.socket(getattr(socket, family))
    s.settimeout(2)
    try:
        s.connect(tuple(address) if family == "AF_INET" else address)
        print("connected", family)
    except OSError as e:
        print("failed", family, e.errno)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("resolved")
except OSError:
    print("no-dns")
"""
    try:
        result, _ = run(sandbox, code)
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            server.close()
        os.unlink(paths[1])
    assert result.reason == "ok", result
    assert "connected" not in result.stdout and len(lines(result, "failed")) == 4, result.stdout
    assert "no-dns" in result.stdout


def test_nothing_outside_is_written_and_nothing_is_left(sandbox, host, tmp_path):
    """Writes everywhere outside its directory fail; symlinks and hard links to host files lead
    nowhere; a directory left `chmod 000` (its own included) is gone with the call; the host
    files the links named are as they were."""
    victim = tmp_path / "victim.txt"
    victim.write_text("host")
    victim.chmod(0o600)
    (tmp_path / "victim_dir").mkdir()
    (tmp_path / "victim_dir" / "keep.txt").write_text("keep")
    outside = [str(tmp_path / "escape.txt"), f"/tmp/xray-escape-{uuid.uuid4().hex}",
               f"/dev/shm/xray-escape-{uuid.uuid4().hex}", "/usr/xray-escape", "/etc/xray-escape", "/xray-escape",
               "/dev/xray-escape", "/proc/xray-escape"]
    code = f"""
import os, shutil
for p in {outside!r}:
    try:
        open(p, "w").write("x")
        print("wrote", p)
    except OSError as e:
        print("refused", e.errno)
os.symlink({str(victim)!r}, "link")
os.symlink({str(tmp_path / "victim_dir")!r}, "dlink")
for attack in (lambda: open("link", "w").write("owned"), lambda: os.chmod("link", 0o777),
               lambda: os.link({str(victim)!r}, "hard"), lambda: shutil.rmtree("dlink/"),
               lambda: os.rename("link", {str(tmp_path / "moved")!r})):
    try:
        attack()
        print("done")
    except OSError as e:
        print("refused", e.errno)
os.makedirs("a/b/c")
open("a/b/c/f", "w").write("x")
for p in ("a/b/c/f", "a/b/c", "a/b", "a", "/sandbox"):
    os.chmod(p, 0)
print("left")
"""
    result, _ = run(sandbox, code)
    assert result.reason == "ok" and "left" in result.stdout, result
    assert "wrote" not in result.stdout and "done" not in result.stdout
    assert len(lines(result, "refused")) == len(outside) + 5
    assert not any(os.path.exists(p) for p in outside + [str(tmp_path / "moved")])
    assert victim.read_text() == "host" and victim.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "victim_dir" / "keep.txt").read_text() == "keep"


def test_kills_reach_nothing_outside(sandbox, host):
    """SIGKILL to a host process, to the test, to the sandbox's own pid 1 and to every process it
    can see (-1): the host's processes live, and the sandbox's pid 1 ignores it."""
    sleeper = subprocess.Popen(["sleep", "60"])
    code = f"""
import os, signal
for pid in ({sleeper.pid}, {os.getpid()}, {os.getppid()}, 1, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print("alive")
"""
    try:
        result, _ = run(sandbox, code)
        assert sleeper.poll() is None
        os.kill(os.getppid(), 0)
    finally:
        sleeper.kill()
    assert (result.reason, result.stdout) == ("ok", "alive\n"), result


BOMBS = {
    "fork bomb": ("""
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("count", n, e.errno)
""", LIMITS.processes - 2, "11"),
    "thread bomb": ("""
import os, threading, time
threading.stack_size(1 << 18)
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        n += 1
except RuntimeError as e:
    print("count", n, str(e).replace(" ", "-"), flush=True)
os._exit(0)
""", LIMITS.processes - 2, "can't-start-new-thread"),
    "memory bomb": ("""
chunks = []
try:
    while True:
        chunks.append(bytearray(16 << 20))
except MemoryError as e:
    print("count", 16 * len(chunks), type(e).__name__)
""", LIMITS.memory_mb, "MemoryError"),
    "disk fill": ("""
import os
try:
    open("big", "wb").write(b"x" * (4 << 20))
except OSError as e:
    print("big", e.errno)
os.remove("big")
n = 0
try:
    while True:
        open(f"f{n}", "wb").write(b"x" * (256 << 10))
        n += 1
except OSError as e:
    print("count", n // 4, e.errno)
""", LIMITS.disk_mb, "28"),
}
"""Programs that grow until a limit stops them: each prints how far it got (processes, threads,
MB) and why it stopped (11 EAGAIN, 28 ENOSPC); the bound its count must stay within."""


@pytest.mark.parametrize("name", BOMBS)
def test_a_bomb_stops_at_its_limit(sandbox, host, name):
    """Each stops at its limit (a uid that is never root bounds processes even on a root host; a
    file past `file_mb` fails with 27 EFBIG), and its processes end with the call."""
    code, bound, why = BOMBS[name]
    result, _ = run(sandbox, code)
    assert result.reason == "ok", (name, result)
    (count, said), = lines(result, "count")
    assert 0 < int(count) <= bound and said == why, (name, result.stdout)
    if name == "disk fill":
        assert lines(result, "big") == [["27"]], result.stdout


@pytest.mark.parametrize("name, code, reasons, says", [
    ("spinning", "while True:\n    pass", {"cpu", "timeout"}, "limit"),
    ("sleeping tree", "import os, subprocess, time\nsubprocess.Popen(['sleep', '600'])\nif os.fork() == 0:\n"
     "    os.setsid()\n    time.sleep(600)\ntime.sleep(600)", {"timeout"}, "wall time limit"),
    ("endless output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", {"output"}, "output limit"),
])
def test_a_program_that_does_not_end_is_stopped_with_all_its_processes(sandbox, host, name, code, reasons, says):
    result, elapsed = run(sandbox, code)
    assert result.reason in reasons and says in result.observation(), (name, result)
    assert elapsed < LIMITS.wall_s + 10.0, (name, elapsed)  # the wall clock starts with the program, after the setup
    assert len(result.stdout) + len(result.stderr) <= LIMITS.output_bytes


def test_a_cancelled_call_takes_its_sandbox_with_it(sandbox, host):
    """A caller's timeout (the tool registry's, an episode's) cancels the call: the sandbox and
    every process in it are gone when the cancellation comes through."""
    code = "import os, subprocess, time\nsubprocess.Popen(['sleep', '600'])\nos.fork()\ntime.sleep(600)"
    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(sandbox.run(code), 1.0))
    assert time.monotonic() - t0 < 8.0


def test_a_host_without_user_namespaces_is_refused_with_the_fix():
    """A user that may make no user namespace (its namespace allows none more): construction
    fails, saying what to allow or to use a remote sandbox; nothing runs unsandboxed."""
    probe = ("from xray.env.sandbox import PythonSandbox, SandboxUnavailable\ntry:\n    PythonSandbox()\n"
             "    print('built')\nexcept SandboxUnavailable as e:\n    print('refused:', e)")
    stage = (f"echo 1 > /proc/sys/user/max_user_namespaces; exec unshare --user --map-user=1000 --map-group=1000 "
             f"{sys.executable} -c \"$0\"")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", stage, probe], capture_output=True,
                          text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.stdout.startswith("refused: this host cannot build the Python sandbox"), (done.stdout, done.stderr)
    assert "No space left on device" in done.stdout and "env.sandbox.url" in done.stdout
    assert "kernel.unprivileged_userns_clone=1" in done.stdout


def test_a_setup_step_that_fails_is_fatal(tmp_path):
    """The sandbox's Python lives in a directory that is gone by the call: the bind mount fails,
    and the call raises instead of running anything."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(os.path.realpath(sys.executable))
    sandbox = PythonSandbox(LIMITS, python=str(python))
    assert sandbox.run_sync("print(1)").stdout == "1\n"
    python.unlink()
    python.parent.rmdir()
    with pytest.raises(SandboxUnavailable, match="(?s)could not be set up for this call.*does not exist.*sandbox.url"):
        sandbox.run_sync("open('/sandbox/ran', 'w')\nprint('ran')")


# -- the remote sandbox --------------------------------------------------------------------------
class _Service(BaseHTTPRequestHandler):
    """SandboxFusion's `POST /run_code`, answered by running the code in a PythonSandbox."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        if self.path != "/run_code" or body.get("language") != "python":
            self.send_error(404)
            return
        result = PythonSandbox(dataclasses.replace(LIMITS, wall_s=body["run_timeout"])).run_sync(body["code"])
        timed_out = result.reason == "timeout"
        run_result = {"status": "TimeLimitExceeded" if timed_out else "Finished", "execution_time": 0.0,
                      "return_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
        answer = json.dumps({"status": "Success" if result.exit_code == 0 else "Failed", "message": "",
                             "compile_result": None, "run_result": run_result, "executor_pod_name": None,
                             "files": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def service(sandbox):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_remote_sandbox_speaks_sandboxfusion(service):
    url = f"http://127.0.0.1:{service.server_address[1]}"
    remote = RemoteSandbox(SandboxConfig(url=url, limits=dataclasses.replace(LIMITS, wall_s=2.0, output_bytes=64)))
    programs = ("print(6 * 7)", "import sys\nprint('no', file=sys.stderr)\nsys.exit(3)", "import time\ntime.sleep(30)",
                "print('y' * 1000)")
    ok, error, slow, long = (remote.run_sync(code) for code in programs)
    assert (ok.reason, ok.exit_code, ok.stdout) == ("ok", 0, "42\n")
    assert (error.reason, error.exit_code, error.stderr) == ("error", 3, "no\n")
    assert slow.reason == "timeout" and slow.observation() == "[stopped: wall time limit]"
    assert long.reason == "output" and long.stdout == "y" * 64
    assert service.requests[0] == {"code": "print(6 * 7)", "language": "python", "run_timeout": 2.0,
                                   "compile_timeout": 2.0, "stdin": "", "files": {}, "fetch_files": []}


def test_the_python_tool_runs_remotely_when_configured(service):
    """A run's `env.sandbox.url` reaches the `builtin:python` tool of its `builtin:tools` episodes."""
    from types import SimpleNamespace

    from xray.config.env import EnvConfig
    from xray.env.tools import ToolCall
    from xray.run.episodes.samples import env_factory

    url = f"http://127.0.0.1:{service.server_address[1]}"
    cfg = SimpleNamespace(env=EnvConfig(name="builtin:tools", sandbox=SandboxConfig(url=url), kwargs={
        "tools": ["builtin:python"], "reward": "xray.rewards.builtin:exact_answer"}))
    env = env_factory(cfg)()
    before = len(service.requests)
    answer = asyncio.run(env.tools.call(ToolCall("python", {"code": "print(sum(range(10)))"})))
    assert answer == "45" and len(service.requests) == before + 1
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    down = RemoteSandbox(SandboxConfig(url=f"http://127.0.0.1:{port}", request_timeout_s=2.0))
    with pytest.raises(RemoteSandboxError, match=f"127.0.0.1:{port}/run_code did not answer.*env.sandbox.url"):
        down.run_sync("print(1)")
    with pytest.raises(ValueError, match="env.sandbox.url='localhost:1'; give the service's address"):
        SandboxConfig(url="localhost:1").check()
