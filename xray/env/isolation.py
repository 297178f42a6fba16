"""How the local Python sandbox is isolated: the command that has the kernel build it, per call.

Sits under `xray/env/sandbox.py`, which runs this command and watches it. Nothing guards the
program from inside its own interpreter (it could reach any such guard): it runs as an ordinary
process with no privilege, and the kernel holds it.

1. `unshare` makes new mount, pid, network, IPC, UTS and cgroup namespaces, and, when the caller
   is not root, a user namespace whose root is the caller. Their first process runs `BOOT`:
2. a new root on a small tmpfs, holding only read-only bind mounts (nosuid, nodev) of /usr,
   /bin, /sbin, /lib*, /etc/ld.so.cache and the Python installation; a /dev with null, zero,
   full, random and urandom; a new /proc, of the new pid namespace; and the program's directory
   `/sandbox`, a tmpfs of `disk_mb`: the one writable place, gone with the namespaces. `pivot_root`
   enters it and the host's tree is unmounted from the namespace. No host socket, file or process
   is reachable from there (the network namespace has only a loopback, down, and owns the
   abstract unix sockets).
3. The program's uid on the host: the caller's when the caller is not root (its user namespace
   can map no other), else a fresh one per call from `PROGRAM_UIDS`, so that RLIMIT_NPROC holds
   (the kernel exempts uid 0 from it) and nothing on the host is the program's.
4. `STAGE2`: the user namespace above the program may hold one user namespace more
   (`user.max_user_namespaces` = 1), the program's own, in which it is uid 1000: it cannot make
   another. `setpriv` clears every capability (bounding, inheritable, ambient), sets no_new_privs
   and makes SIGKILL its parent-death signal; `prlimit` sets the limits; the program's shell, pid 1
   of the namespace, prints `READY` on stderr and runs `python -I main.py`, its stderr the pipe
   the host passed as the chain's stdin (so that nothing the setup or `unshare` says mixes with it).
Each step must succeed (`set -e`): a call that never printed `READY` raises instead of running
(`xray/env/sandbox.py`). The tools are util-linux's (`unshare`, `setpriv`, `prlimit`, `mount`,
`pivot_root`) and coreutils'.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from xray.config.sandbox import SandboxLimits

PROGRAM_UIDS = (1_000_000_000, 2_000_000_000)
"""Where a root host draws each call's program uid (and gid): far above any real user's."""
INNER_UID = 1000
"""The program's uid inside its own user namespace."""
READY = "\x1exray-sandbox-ready\n"
"""Printed on stderr by the program's shell once every step of the isolation is in place."""
DIRECTORY = "/sandbox"
"""The program's directory (working directory, HOME and TMPDIR) inside the new root."""
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top directories of the host's root shown read-only (or, where the host has a symlink, the symlink)."""
FILES = ("/etc/ld.so.cache",)
"""Host files shown read-only (the dynamic linker's cache: Debian's multiarch libraries)."""
DEVICES = ("null", "zero", "full", "random", "urandom")
TOOLS = ("unshare", "setpriv", "prlimit", "mount", "umount", "pivot_root", "sh", "cp", "chown", "mkdir",
         "ln", "touch", "rmdir")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RESERVED = (DIRECTORY, "/proc", "/dev", "/etc")

PREFIXES = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
            "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]))")
"""Asks the sandbox's Python where its installation lives."""


class SandboxUnavailable(RuntimeError):
    """This host cannot build the sandbox; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    """What the new root shows of the host."""

    links: tuple[tuple[str, str], ...]
    """(path, target): the host's symlinks among `SYSTEM` (`/bin -> usr/bin`), made again."""
    dirs: tuple[str, ...]
    """Host directories bound read-only at the same path: `SYSTEM`'s, then the Python installation's."""
    files: tuple[str, ...]
    """Host files bound read-only at the same path."""


def layout(python: str) -> Layout:
    """The new root for `python` (its installation and virtual environment, wherever they are)."""
    missing = [t for t in TOOLS if shutil.which(t, path=PATH) is None]
    if missing:
        raise SandboxUnavailable(f"the Python sandbox needs {', '.join(missing)} (util-linux, coreutils); "
                                 "install them (Debian: apt-get install util-linux coreutils) or set "
                                 "env.sandbox.url to a remote sandbox")
    links, dirs = [], []
    for name in SYSTEM:
        path = "/" + name
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            dirs.append(path)
    probe = subprocess.run([python, "-I", "-c", PREFIXES], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"the sandbox's Python {python!r} does not start: {probe.stderr.strip()[-500:]}")
    found = set()
    for path in json.loads(probe.stdout) + [os.path.dirname(os.path.abspath(python))]:
        found.update({os.path.abspath(path), os.path.realpath(path)})
    found -= {"/", *dirs}
    clash = [p for p in found if any(p == r or p.startswith(r + "/") or r.startswith(p + "/") for r in RESERVED)]
    if clash:
        raise SandboxUnavailable(f"the sandbox's Python lives under {clash[0]}, which the sandbox uses for its own "
                                 f"{', '.join(RESERVED)}; install it elsewhere or set env.sandbox.url")
    found = {p for p in found if not any(p.startswith(q + "/") for q in found)}  # the outermost of nested ones
    files = tuple(f for f in FILES if os.path.isfile(f))
    return Layout(tuple(links), tuple(dirs) + tuple(sorted(found)), files)


def boot_script(lay: Layout, limits: SandboxLimits, python: str, root_host: bool) -> str:
    """`BOOT` (module docstring): run as `sh -c BOOT boot BASE UID GID`, BASE holding `main.py` and
    an empty `root/`; UID and GID own the program's directory, as the boot's namespace sees them."""
    q = shlex.quote
    lines = ["set -eu", 'base=$1 puid=$2 pgid=$3',
             'ro() { mount --bind "$1" "$2"; mount -o remount,bind,ro,nosuid,nodev "$2"; }',
             'mount -t tmpfs -o mode=0755,size=1m,nr_inodes=4096 xray-root "$base/root"',
             'cd "$base/root"', "mkdir proc dev etc .old " + DIRECTORY.lstrip("/")]
    lines += [f"ln -s {q(target)} {q(path.lstrip('/'))}" for path, target in lay.links]
    for path in lay.dirs:
        lines += [f"mkdir -p {q('.' + path)}", f"ro {q(path)} {q('.' + path)}"]
    for path in lay.files:
        lines += [f"mkdir -p {q('.' + os.path.dirname(path))}", f"touch {q('.' + path)}",
                  f"ro {q(path)} {q('.' + path)}"]
    lines += ["mount -t tmpfs -o mode=0755,size=64k,nr_inodes=64,nosuid,noexec xray-dev dev"]
    for dev in DEVICES:
        lines += [f"touch dev/{dev}", f"mount --bind /dev/{dev} dev/{dev}"]
    lines += [f"ln -s /proc/self/fd/{n} dev/{name}" for n, name in enumerate(("stdin", "stdout", "stderr"))]
    lines += ["ln -s /proc/self/fd dev/fd", "mount -o remount,bind,ro,nosuid,noexec dev",
              f"mount -t tmpfs -o size={limits.disk_mb}m,nr_inodes={64 * limits.disk_mb},mode=0700,"
              f"uid=$puid,gid=$pgid,nosuid,nodev xray-sandbox {DIRECTORY.lstrip('/')}",
              f'cp "$base/main.py" .{DIRECTORY}/main.py', f'chown "$puid:$pgid" .{DIRECTORY}/main.py',
              "mount -t proc -o nosuid,nodev,noexec proc proc",
              "pivot_root . .old", "cd /", "umount -l /.old", "rmdir /.old", "mount -o remount,bind,ro /"]
    stage2 = q(stage2_script(limits, python))
    if root_host:
        lines.append('exec setpriv --reuid="$puid" --regid="$pgid" --clear-groups -- unshare --user --map-root-user '
                     f"-- sh -c {stage2} stage2")
    else:
        lines.append(f"exec sh -c {stage2} stage2")
    return "\n".join(lines) + "\n"


def stage2_script(limits: SandboxLimits, python: str) -> str:
    """`STAGE2` (module docstring), run as root of the user namespace above the program's."""
    cpu, q = limits.cpu_s, shlex.quote
    # READY on the setup's stderr; then stderr becomes the program's pipe (the chain's stdin) and
    # stdin /dev/null; `exit` keeps the shell as pid 1 (a shell may exec its last command)
    run = 'printf "%s" "$0" >&2; exec 2>&0 0</dev/null; "$@"; exit $?'
    return "\n".join([
        "set -eu", "echo 1 > /proc/sys/user/max_user_namespaces", f"cd {DIRECTORY}",
        f"exec unshare --user --map-user={INNER_UID} --map-group={INNER_UID} --keep-caps -- "
        "setpriv --no-new-privs --inh-caps=-all --ambient-caps=-all --bounding-set=-all --pdeathsig=KILL -- "
        f"prlimit --cpu={cpu}:{cpu + 1} --as={limits.memory_mb << 20} --fsize={limits.file_mb << 20} "
        f"--nproc={limits.processes} --nofile={limits.open_files} --core=0 -- "
        f"sh -c {q(run)} {q(READY)} {q(python)} -I main.py"]) + "\n"


def command(boot: str, base: str, uid: int, root_host: bool) -> list[str]:
    """The host's command for one call (`base` as in `boot_script`)."""
    user = [] if root_host else ["--user", "--map-root-user"]
    return (["setpriv", "--pdeathsig=KILL", "--",  # the caller gone (a crash), the sandbox goes with it
             "unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child",
             "--propagation", "private", "--", "sh", "-c", boot, "boot", base, str(uid), str(uid)])


def environment() -> dict[str, str]:
    """The program's environment (nothing of the host's)."""
    return {"PATH": PATH, "HOME": DIRECTORY, "TMPDIR": DIRECTORY, "LANG": "C.UTF-8"}
