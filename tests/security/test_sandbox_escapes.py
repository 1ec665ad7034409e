"""Hostile snippets through the real sandbox, each side effect checked from outside it.

Every snippet runs with the audit hook switched off (audit_hook=False), so what holds is the outer
wall alone: bubblewrap namespaces, the seccomp filter and the rlimits. After every run the test checks,
from this process: a decoy process and this process are alive, not stopped, not reniced or re-pinned;
a directory outside holds exactly what it held; loopback listeners (TCP, UDP, abstract unix) got
nothing; no process is left behind; the environment secret did not come back; the run ended in time.
Snippets that try to forge a result go through CodingEnv.score with every layer on, and must score 0.
One test attacks the runner that holds the result channel (its /proc files, signals, a frame walk, a
forged report); another pins the known limit: a call's child chooses that call's value, nothing more.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trace_lightning.envs import CodingEnv, Problem, run_sandboxed

TIMEOUT_S = 1.0
SLACK_S = 3.0  # bwrap + interpreter start and namespace teardown on a loaded 2-core machine
SECRET_VAR = "TL_SECURITY_TEST_SECRET"
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Outside:
    """What the snippets aim at, and how it looked before they ran."""

    decoy: Any  # subprocess.Popen of a `sleep` outside the sandbox
    dir: Path
    files: dict[str, bytes]
    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    unix_name: str
    secret: str
    priority: int
    affinity: set[int]
    hostname: str
    earlier: set[int]  # processes this test process already had (e.g. a scoring pool's forkserver)

    def fields(self) -> dict[str, Any]:
        return {
            "pid": self.decoy.pid,
            "ppid": os.getpid(),
            "dir": str(self.dir),
            "port": self.tcp.getsockname()[1],
            "uport": self.udp.getsockname()[1],
            "unix": self.unix_name,
            "var": SECRET_VAR,
        }


def _state(pid: int) -> str:
    """The scheduler state letter of pid ("S", "R", "T" stopped, "Z" zombie ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _descendants(root: int) -> set[int]:
    """Every live or zombie process below root, from a /proc walk."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def _reaped_zombie(pid: int) -> bool:
    """True for a zombie (a process that has already exited), which this subreaper then reaps."""
    try:
        if _state(pid) != "Z":
            return False
    except OSError:
        return True
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


def _cmdline(pid: int) -> str:
    try:
        return f"{pid} {_state(pid)} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return f"{pid} (gone)"


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: (p.read_bytes() if p.is_file() and not p.is_symlink() else b"<other>") for p in path.iterdir()}


@pytest.fixture(scope="module", autouse=True)
def subreaper() -> Iterator[None]:
    """Orphans of the sandbox would re-parent to this process, so a leftover cannot hide from _descendants."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Outside]:
    (tmp_path / "secret.txt").write_bytes(b"the parent's data")
    tmp_path.chmod(0o777)
    secret = secrets.token_hex(16)
    monkeypatch.setenv(SECRET_VAR, secret)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix_name = f"tl-security-{secret[:8]}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + unix_name)
    unix.listen()
    for s in (tcp, udp, unix):
        s.setblocking(False)
    decoy = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield Outside(decoy, tmp_path, _snapshot(tmp_path), tcp, udp, unix, unix_name, secret,
                  os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0), socket.gethostname(),
                  _descendants(os.getpid()) - {decoy.pid})  # fmt: skip
    decoy.kill()
    decoy.wait()
    for s in (tcp, udp, unix):
        s.close()


def _received_nothing(sock: socket.socket) -> bool:
    try:
        if sock.type == socket.SOCK_DGRAM:
            sock.recvfrom(64)
        else:
            sock.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def check_contained(out: Outside, result: Any, elapsed: float) -> None:
    """Every side effect a snippet could have had, checked from here."""
    assert elapsed < TIMEOUT_S + SLACK_S, f"took {elapsed:.1f} s"
    assert out.decoy.poll() is None and _state(out.decoy.pid) not in "TtZ", "the decoy was killed or stopped"
    assert _state(os.getpid()) not in "Tt"
    for pid in (0, out.decoy.pid):
        assert os.getpriority(os.PRIO_PROCESS, pid) == out.priority, "a process was reniced"
        assert os.sched_getaffinity(pid) == out.affinity, "a process was re-pinned"
    assert _snapshot(out.dir) == out.files, "the directory outside changed"
    assert socket.gethostname() == out.hostname, "the hostname changed"
    assert oct(out.dir.stat().st_mode & 0o777) == oct(0o777)
    assert all(_received_nothing(s) for s in (out.tcp, out.udp, out.unix)), "a listener outside was reached"
    left = {pid for pid in _descendants(os.getpid()) - {out.decoy.pid} - out.earlier if not _reaped_zombie(pid)}
    assert not left, f"the sandbox left processes behind: {[_cmdline(pid) for pid in left]}"
    assert out.secret not in repr(result), "the environment secret leaked"


def run_hostile(out: Outside, code: str, timeout_s: float = TIMEOUT_S) -> Any:
    source = code.format(**out.fields())
    start = time.monotonic()
    result = run_sandboxed(source, "f", [(0,)], timeout_s=timeout_s, audit_hook=False)
    check_contained(out, result, time.monotonic() - start)
    return result


def _returned(result: Any) -> Any:
    """What f returned, or None when the run or the call failed."""
    if result.status == "ok" and result.outputs and result.outputs[0][0] == "ok":
        return result.outputs[0][1]
    return None


def _host_users() -> set[str]:
    return {line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines() if line}


def _expect_refused(result: Any) -> None:
    assert _returned(result) is None, f"the call succeeded: {result}"


# name -> (source defining f, an extra check on the result; the outside checks run for every case)
HOSTILE: dict[str, tuple[str, Callable[[Any], None] | None]] = {
    # --- kill or stop the parent, the decoy, anything visible
    "kill-getppid": ("import os\ndef f(x):\n    os.kill(os.getppid(), 9)\n    return os.getppid()", None),
    "stop-getppid": ("import os\ndef f(x):\n    os.kill(os.getppid(), 19)\n    return 1", None),
    "kill-host-parent-pid": ("import os\ndef f(x):\n    os.kill({ppid}, 9)\n    return 1", _expect_refused),
    "stop-decoy-pid": ("import os\ndef f(x):\n    os.kill({pid}, 19)\n    return 1", _expect_refused),
    "kill-everything": ("import os\ndef f(x):\n    os.kill(-1, 9)\n    return 1", None),
    "killpg-parent": ("import os\ndef f(x):\n    os.killpg({ppid}, 9)\n    return 1", _expect_refused),
    "pidfd-kill-parent": (
        "import os, signal\ndef f(x):\n    fd = os.pidfd_open(os.getppid())\n"
        "    signal.pidfd_send_signal(fd, 9)\n    return 1", _expect_refused),
    "pidfd-stop-host-pid": (
        "import os, signal\ndef f(x):\n    fd = os.pidfd_open({ppid})\n"
        "    signal.pidfd_send_signal(fd, 19)\n    return 1", _expect_refused),
    "proc-walk-kill": (
        "import os\ndef f(x):\n    n = 0\n    for p in os.listdir('/proc'):\n"
        "        if p.isdigit() and int(p) != os.getpid():\n            try:\n                os.kill(int(p), 9)\n"
        "                n += 1\n            except OSError:\n                pass\n    return n", None),
    "proc-walk-stop": (
        "import os\ndef f(x):\n    for p in os.listdir('/proc'):\n        if p.isdigit() and int(p) != os.getpid():\n"
        "            try:\n                os.kill(int(p), 19)\n            except OSError:\n                pass\n"
        "    return sorted(int(p) for p in os.listdir('/proc') if p.isdigit())",
        lambda r: _returned(r) is None or max(_returned(r)) < 10),
    "ptrace-parent": (
        "import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return [libc.ptrace(16, {ppid}, 0, 0), libc.ptrace(16, 1, 0, 0), ctypes.get_errno()]",
        lambda r: _returned(r) is None or _returned(r)[:2] == [-1, -1]),
    # --- files outside the sandbox
    "write-outside-dir": ("def f(x):\n    open('{dir}/pwned', 'w').write('x')\n    return 1", _expect_refused),
    "overwrite-outside-file": ("def f(x):\n    open('{dir}/secret.txt', 'w').write('x')\n    return 1",
                               _expect_refused),
    "unlink-outside-file": ("import os\ndef f(x):\n    os.unlink('{dir}/secret.txt')\n    return 1", _expect_refused),
    "chmod-outside-dir": ("import os\ndef f(x):\n    os.chmod('{dir}', 0o700)\n    return 1", _expect_refused),
    "mknod-outside": ("import os, stat\ndef f(x):\n    os.mknod('{dir}/null', stat.S_IFCHR | 0o666, os.makedev(1, 3))\n"
                      "    return 1", _expect_refused),
    "mknod-private-tmp": ("import os, stat\ndef f(x):\n"
                          "    os.mknod('/tmp/mem', stat.S_IFCHR | 0o666, os.makedev(1, 1))\n    return 1",
                          _expect_refused),
    "mkfifo-outside": ("import os\ndef f(x):\n    os.mkfifo('{dir}/fifo')\n    return 1", _expect_refused),
    "symlink-into-parent-dir": (
        "import os\ndef f(x):\n    os.symlink('{dir}', '/tmp/link')\n    open('/tmp/link/pwned', 'w').write('x')\n"
        "    return 1", _expect_refused),
    "symlink-planted-outside": ("import os\ndef f(x):\n    os.symlink('/etc/shadow', '{dir}/link')\n    return 1",
                                _expect_refused),
    "proc-root-escape": ("def f(x):\n    open('/proc/1/root{dir}/pwned', 'w').write('x')\n    return 1",
                         _expect_refused),
    "write-read-only-root": (
        "import sys\ndef f(x):\n    open(sys.prefix + '/lib/pwned-by-sandbox', 'w').write('x')\n    return 1",
        _expect_refused),
    "mount-over-outside-dir": (
        "import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return [libc.mount(b'none', b'{dir}', b'tmpfs', 0, None),\n"
        "            libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)]",
        lambda r: _returned(r) is None or _returned(r) == [-1, -1]),
    "chroot-breakout": (
        "import os\ndef f(x):\n    os.mkdir('/tmp/j')\n    os.chroot('/tmp/j')\n    os.chdir('../../../..')\n"
        "    return os.listdir('.')", _expect_refused),
    "new-user-namespace": (
        "import ctypes\ndef f(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return libc.unshare(0x10000000)", lambda r: _returned(r) in (None, -1)),
    # --- other processes
    "renice-parent": ("import os\ndef f(x):\n    os.setpriority(os.PRIO_PROCESS, {ppid}, 19)\n    return 1",
                      _expect_refused),
    "renice-all-of-user": ("import os\ndef f(x):\n    os.setpriority(os.PRIO_USER, os.getuid(), 19)\n    return 1",
                           _expect_refused),
    "renice-init": ("import os\ndef f(x):\n    os.setpriority(os.PRIO_PROCESS, 1, 19)\n    return 1", _expect_refused),
    "repin-parent": ("import os\ndef f(x):\n    os.sched_setaffinity({ppid}, {{0}})\n    return 1", _expect_refused),
    "repin-decoy": ("import os\ndef f(x):\n    os.sched_setaffinity({pid}, {{0}})\n    return 1", _expect_refused),
    "sethostname": ("import socket\ndef f(x):\n    socket.sethostname('pwned')\n    return socket.gethostname()",
                    _expect_refused),
    # --- privileges
    "exec-setuid-binary": ("import os\ndef f(x):\n    os.execv('/usr/bin/su', ['su', '-c', 'kill -9 {ppid}'])", None),
    "process-flags": (
        "def f(x):\n    keep = ('Uid:', 'CapEff:', 'CapBnd:', 'NoNewPrivs:', 'Seccomp:')\n"
        "    return [ln.split() for ln in open('/proc/self/status') if ln.startswith(keep)]",
        lambda r: _returned(r) == [["Uid:"] + ["65534"] * 4, ["CapEff:", "0" * 16], ["CapBnd:", "0" * 16],
                                   ["NoNewPrivs:", "1"], ["Seccomp:", "2"]]),
    # --- reading what is not ours
    "pwd-module": ("import pwd\ndef f(x):\n    return [p.pw_name for p in pwd.getpwall()]",
                   lambda r: not set(_returned(r) or []) & (_host_users() - {"nobody"})),
    "proc-root-only-files": (
        "def f(x):\n    out = []\n    for n in ('slabinfo', 'timer_list', 'vmallocinfo', 'kmsg', 'pagetypeinfo'):\n"
        "        try:\n            out.append(len(open('/proc/' + n, 'rb').read(4096)))\n"
        "        except OSError as e:\n            out.append(type(e).__name__)\n    return out",
        lambda r: _returned(r) == ["PermissionError"] * 5),
    "read-etc-passwd": ("def f(x):\n    return open('/etc/passwd').read()", _expect_refused),
    "stat-parent-file": ("import os\ndef f(x):\n    return os.stat('{dir}/secret.txt').st_size", _expect_refused),
    "read-parent-file": ("def f(x):\n    return open('{dir}/secret.txt').read()", _expect_refused),
    "readlink-parent-cwd": ("import os\ndef f(x):\n    return os.readlink('/proc/{ppid}/cwd')", _expect_refused),
    "readlink-parent-exe": ("import os\ndef f(x):\n    return os.readlink('/proc/' + str(os.getppid()) + '/exe')",
                            lambda r: "sleep" not in repr(r) and "pytest" not in repr(r)),
    "list-home-dirs": ("import os\ndef f(x):\n    return [os.listdir(d) for d in ('/root', '/home', '/work')]",
                       _expect_refused),
    # --- network
    "tcp-loopback-listener": ("import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}), 0.5)\n"
                              "    return 1", _expect_refused),
    "udp-loopback-listener": (
        "import socket\ndef f(x):\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    return s.sendto(b'x', ('127.0.0.1', {uport}))", None),
    "abstract-unix-listener": (
        "import socket\ndef f(x):\n    s = socket.socket(socket.AF_UNIX)\n    s.connect('\\0{unix}')\n    return 1",
        _expect_refused),
    "socket-vsock": ("import socket\ndef f(x):\n    return socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).fileno()",
                     _expect_refused),
    "socket-netlink-route": ("import socket\ndef f(x):\n    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n"
                             "    s.bind((0, 0))\n    return s.getsockname()", _expect_refused),
    "socket-netlink-audit": ("import socket\ndef f(x):\n    return socket.socket(16, socket.SOCK_RAW, 9).fileno()",
                             _expect_refused),
    "socket-packet": ("import socket\ndef f(x):\n    return socket.socket(17, socket.SOCK_RAW, 0).fileno()",
                      _expect_refused),
    "socket-inet6": ("import socket\ndef f(x):\n    return socket.socket(socket.AF_INET6).fileno()", _expect_refused),
    "socket-inet-raw": ("import socket\ndef f(x):\n    return socket.socket(2, socket.SOCK_RAW, 1).fileno()",
                        _expect_refused),
    "socketpair-inet": ("import socket\ndef f(x):\n    return len(socket.socketpair(2))", _expect_refused),
    "socket-unix-allowed": ("import socket\ndef f(x):\n    a, b = socket.socketpair()\n    a.send(b'hi')\n"
                            "    return b.recv(2).decode()", lambda r: _returned(r) == "hi"),
    "network-interfaces": ("import socket\ndef f(x):\n    return [n for _, n in socket.if_nameindex()]",
                           lambda r: _returned(r) in (None, ["lo"])),
    # --- secrets in the environment
    "environ-secret": ("import os\ndef f(x):\n    return os.environ.get('{var}', 'absent')",
                       lambda r: _returned(r) == "absent"),
    "environ-empty": ("import os\ndef f(x):\n    return sorted(os.environ)",
                      lambda r: set(_returned(r)) <= {"LC_CTYPE", "PWD"}),
    "proc-self-environ": ("def f(x):\n    return open('/proc/self/environ').read()", None),
    "proc-parent-environ": ("def f(x):\n    return open('/proc/{ppid}/environ').read()", _expect_refused),
    "proc-init-environ": ("def f(x):\n    return open('/proc/1/environ').read()", None),
    # --- bombs
    "fork-bomb": ("import os\ndef f(x):\n    while True:\n        os.fork()", _expect_refused),
    "thread-bomb": ("import _thread, time\ndef f(x):\n    while True:\n"
                    "        _thread.start_new_thread(time.sleep, (60,))", _expect_refused),
    "spawn-sleep": ("import os\ndef f(x):\n    return os.posix_spawn('/usr/bin/sleep', ['sleep', '60'], {{}})",
                    _expect_refused),
    "memory-bomb": ("def f(x):\n    return len(bytearray(8 << 30))", _expect_refused),
    "memory-creep": ("def f(x):\n    a = []\n    while True:\n        a.append(' ' * (1 << 20))", _expect_refused),
    "cpu-spin": ("def f(x):\n    while True:\n        pass", lambda r: r.status in ("timeout", "crashed")),
    "output-bomb": ("import os\ndef f(x):\n    while True:\n        os.write(1, b'x' * (1 << 20))",
                    lambda r: r.outputs == [("error", "OutputLimit")]),
    "tmp-disk-bomb": ("def f(x):\n    with open('/tmp/big', 'wb') as fh:\n        while True:\n"
                      "            fh.write(b'x' * (1 << 20))", _expect_refused),
    "dev-shm-fill": ("def f(x):\n    open('/dev/shm/big', 'wb').write(b'x' * (64 << 20))\n    return 1",
                     _expect_refused),
    "fd-bomb": ("import os\ndef f(x):\n    while True:\n        os.dup(0)", _expect_refused),
    # --- leftover processes
    "daemonise-double-fork": (
        "import os, time\ndef f(x):\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n        os._exit(0)\n    return 1", _expect_refused),
    "background-thread-outlives": (
        "import _thread, time\ndef f(x):\n    _thread.start_new_thread(time.sleep, (60,))\n    return 1",
        _expect_refused),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_snippet_is_contained(name: str, outside: Outside) -> None:
    code, check = HOSTILE[name]
    result = run_hostile(outside, code)
    assert result.status in ("ok", "error", "timeout", "crashed")
    if check is not None:
        assert check(result) is not False, f"{name}: {result}"


AFFINE = Problem(
    prompt="f(0)=3;f(1)=5;f(2)=7\nf=lambda x:",
    answer="2*x+3",
    metadata={"kind": "int", "tests": [[0], [1], [2], [10], [-4]], "expected": [3, 5, 7, 23, -5]},
)
RIGHT = "[('ok', 3), ('ok', 5), ('ok', 7), ('ok', 23), ('ok', -5)]"
# Wrong programs (f returns x, or nothing useful) that try to make the parent read the right answers.
FORGERIES = {
    "old-marker-line": "def f(x):\n    import sys\n    sys.stdout.write('\\n\\x00__sandbox_results__:' + "
    "repr(('ok', RIGHT)) + '\\n')\n    sys.stdout.flush()\n    sys.modules['posix']._exit(0)",
    "guessed-token-frame": "def f(x):\n    import sys\n    p = repr(('ok', RIGHT)).encode()\n"
    "    sys.modules['posix'].write(1, b'\\n' + b'0' * 32 + b' ' + str(len(p)).encode() + b'\\n' + p)\n    return x",
    "frames-to-every-fd": "def f(x):\n    import sys\n    p = repr(('ok', RIGHT)).encode()\n    for fd in range(64):\n"
    "        try:\n            sys.modules['posix'].write(fd, b'\\n' + p)\n        except OSError:\n"
    "            pass\n    return x",
    "repr-injection": "class R:\n    def __repr__(self):\n"
    "        return \"3), ('ok', 5), ('ok', 7), ('ok', 23), ('ok', -5\"\ndef f(x):\n    return R()",
    "short-repr-crash": "class R:\n    __repr__ = lambda s: '0]),1,(0'\nf = lambda x: R()",
    "repr-ends-result-early": "class R:\n    __repr__ = lambda s: '3),1,2,3,4])#'\nf = lambda x: R()",
    "eq-always-true": "class E:\n    __eq__ = lambda s, o: True\n    __hash__ = None\nf = lambda x: E()",
    "int-subclass": "class I(int):\n    __eq__ = lambda s, o: True\n    __repr__ = lambda s: '3'\nf = lambda x: I(x)",
    "str-subclass-repr": "class S(str):\n    __repr__ = lambda s: '3'\nf = lambda x: S('3')",
    "repr-raises": "class R:\n    def __repr__(self):\n        raise SystemExit(0)\nf = lambda x: R()",
    "patched-builtins": "import builtins\nbuiltins.type = lambda o: int\nbuiltins.repr = lambda o: '3'\n"
    "builtins.isinstance = lambda *a: True\nf = lambda x: x",
    "patched-posix-write": "import sys\nposix = sys.modules['posix']\nw = posix.write\n"
    "posix.write = lambda fd, b: w(fd, b.replace(b'0', b'3'))\nf = lambda x: x",
    "stdout-redirected": "import sys\nsys.modules['posix'].dup2(2, 1)\nf = lambda x: x",
    "recursive-list": "def f(x):\n    a = []\n    a.append(a)\n    return a",
    "deep-nesting": "def f(x):\n    a = 3\n    for _ in range(5000):\n        a = [a]\n    return a",
    "huge-int": "def f(x):\n    return 10 ** 100000",
    "huge-string": "def f(x):\n    return 'x' * (64 << 20)",
    "exception-name-metaclass": "class M(type):\n    __name__ = property(lambda c: 3)\n"
    "class E(Exception, metaclass=M):\n    pass\ndef f(x):\n    raise E()",
    "systemexit-at-import": "import sys\nsys.exit(0)\nf = lambda x: x",
    "recursion-limit": "import sys\nsys.setrecursionlimit(1)\nf = lambda x: [[x]]",
}


def score_contained(out: Outside, response: str) -> float:
    env = CodingEnv(timeout_s=TIMEOUT_S)
    start = time.monotonic()
    reward = env.score(AFFINE, response)
    check_contained(out, reward, time.monotonic() - start)
    return reward


def test_honest_answer_scores_one(outside: Outside) -> None:
    assert score_contained(outside, "def f(x):\n    return 2 * x + 3") == 1.0


# The runner (pid 1 of the sandbox) frames the report on a stdout no child holds. Each call's child tries to
# reach it: its fds and memory through /proc, signals, then a forged report and frames for every call, with
# whatever a signal handler's frame walk finds in its locals (the attack that read the old per-run token).
ATTACK_RUNNER = """import os, signal, sys
def f(x):
    tried = []
    for path, mode in (('/proc/1/fd/1', os.O_WRONLY), ('/proc/1/fd/0', os.O_RDONLY), ('/proc/1/mem', os.O_RDWR),
                       ('/proc/1/environ', os.O_RDONLY)):
        try:
            os.close(os.open(path, mode))
            tried.append('opened')
        except OSError as e:
            tried.append(type(e).__name__)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(1, sig)
        except OSError:
            pass
    found = []
    def walk(signum, frame):
        while frame is not None:
            found.extend(repr(v)[:200] for v in frame.f_locals.values())
            frame = frame.f_back
    signal.signal(signal.SIGALRM, walk)
    signal.raise_signal(signal.SIGALRM)
    if x == 0:
        forged = ''.join("0 0 11\\n\\n\\x1e('ok',%d)\\n" % want for want in RIGHT) + 'end\\n'
        for fd in range(64):
            try:
                os.write(fd, forged.encode() + b"\\n\\x1e('ok',3)\\n")
            except OSError:
                pass
        os._exit(0)
    return [tried, len(found) > 0, x]
"""


def test_the_runner_cannot_be_reached_and_a_child_speaks_only_for_its_call(outside: Outside) -> None:
    source = ATTACK_RUNNER.replace("RIGHT", repr([3, 5, 7, 23, -5]))
    start = time.monotonic()
    result = run_sandboxed(source, "f", [(0,), (1,), (2,)], timeout_s=TIMEOUT_S, audit_hook=False)
    check_contained(outside, result, time.monotonic() - start)
    assert result.status == "ok", result
    refused = ["PermissionError"] * 4
    # Call 0 wrote a whole forged report and frames to every fd it had: only its own value counts, and that
    # value is one f could have returned (3). Calls 1 and 2 ran after the signals: the runner was untouched.
    assert result.outputs == [("ok", 3), ("ok", [refused, True, 1]), ("ok", [refused, True, 2])]
    assert CodingEnv(timeout_s=TIMEOUT_S).score(AFFINE, source) == 0.0


def test_known_limit_a_child_chooses_its_own_calls_result(outside: Outside) -> None:
    """Pinned: code may print a frame and exit instead of returning. What it can claim for its call is exactly
    what f could have returned there (a plain literal), nothing for other calls, so a reward is 1.0 only when
    every call's value is right. Printing and returning the right values is solving the task."""
    printed = (
        "def f(x):\n    import posix\n    posix.write(1, b\"\\n\\x1e('ok',\" + repr(2 * x + 3).encode() + b')\\n')\n"
        "    posix._exit(0)"
    )
    calls = [(0,), (1,), (10,)]
    assert run_sandboxed(printed, "f", calls).outputs == run_sandboxed("f = lambda x: 2 * x + 3", "f", calls).outputs
    assert score_contained(outside, printed) == 1.0
    wrong_type = "import posix\ndef f(x):\n    posix.write(1, b\"\\n\\x1e('ok',{1: 2})\\n\")\n    posix._exit(0)"
    assert run_sandboxed(wrong_type, "f", [(0,)]).outputs == [("error", "BadResult")]


@pytest.fixture
def many_fds() -> Iterator[list[int]]:
    """This process holding more than 1024 open files, as a trainer with many shards and sockets does."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the fd limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    yield fds
    for fd in fds:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_honest_answer_scores_one_while_the_trainer_holds_over_1024_fds(outside: Outside, many_fds: list[int]) -> None:
    assert max(many_fds) >= 1024
    assert score_contained(outside, "def f(x):\n    return 2 * x + 3") == 1.0
    assert score_contained(outside, "def f(x):\n    return x") == 0.0


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_result_scores_zero(name: str, outside: Outside) -> None:
    source = FORGERIES[name].replace("RIGHT", RIGHT)
    response = source if source.startswith("def ") else "def f(x):\n    return x\n" + source
    assert score_contained(outside, response) == 0.0
