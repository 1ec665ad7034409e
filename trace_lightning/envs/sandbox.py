"""Run untrusted model code in a locked-down subprocess and return what its function computed.

Layers, outermost first; none is trusted alone:
- bubblewrap + seccomp (isolation.py): own user/PID/network/IPC/UTS/mount namespaces, uid 65534, a
  read-only root with only a private size-capped /tmp writable, no environment, no process creation
  and no pidfd/ptrace/mount/mknod/renice syscalls. `isolation="none"` drops this layer, explicitly;
- a fresh `python -I -S` (no site-packages, no PYTHON* variables) in an empty working directory;
- resource limits set by the harness before the code runs: CPU seconds (SIGXCPU ends a busy loop),
  address space (big allocations raise MemoryError), file size (stdout is a size-capped file, so
  flooding it kills the child), no core dumps, a small fd table, no new processes;
- an audit hook (PEP 578), installed just before the code is compiled, that allows only the `compile`
  and `exec` events: imports of modules not yet loaded, open(), os.system / fork / exec, sockets,
  ctypes, frame and gc introspection, setrlimit ... raise PermissionError;
- a wall-clock timeout in the parent, counted from when bwrap has set the namespaces up, after which
  it kills the sandbox's PID namespace (its init, so the kernel kills every process in it) and waits
  until it is gone.

Results come back on stdout in one frame written by the harness after the code returned: a per-run
random token (sent on stdin, kept only in a local the code cannot reach), the payload length, and a
Python literal built by the harness from exact builtin types (an object's own __repr__ / __eq__ never
runs). The parent reads at most output_kb, parses with ast.literal_eval (never eval) and checks the
shape. Expected outputs never enter the sandbox: the parent compares. run_sandboxed never raises for
anything the code does.
"""

from __future__ import annotations

import ast
import json
import marshal
import math
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

from trace_lightning.envs.isolation import bwrap_argv, interpreter, launch_for, require_isolation, seccomp_filter

STARTUP_S = 10.0
"""Longest wait for bwrap to report its namespaces (not counted in timeout_s)."""

# Run by the child as `python -I -S -c _HARNESS`; the job (source, calls, token, limits) arrives on stdin.
_HARNESS = r"""
import marshal, posix, resource, sys

def _guard(event, args, _allowed=frozenset(("compile", "exec"))):
    if event not in _allowed:
        raise PermissionError("sandbox refused " + event)

def _main(_write=posix.write, _exit=posix._exit, _join=",".join, _len=len, _str=str):
    job = b""
    while True:
        chunk = posix.read(0, 65536)
        if not chunk:
            break
        job += chunk
    source, entry, calls, token, limits, audit = marshal.loads(job)
    del job
    # Locals, not globals: the code can rebind __main__'s names, never these.
    def _literal(v, depth=0, _type=type, _int=int.__repr__, _float=float.__repr__, _str=str.__repr__,
                 _inf=float("inf")):
        t = _type(v)
        if depth > 30:
            raise ValueError("nested too deep")
        if t is int:
            return _int(v)
        if t is str:
            return _str(v)
        if t is bool or v is None:
            return "True" if v is True else "False" if v is False else "None"
        if t is float and -_inf < v < _inf:
            return _float(v)
        if t is list or t is tuple:
            body = ",".join([_literal(x, depth + 1) for x in v])
            return "[" + body + "]" if t is list else "(" + body + ",)"
        raise TypeError("not a plain literal")

    def _name(e, _type=type, _str=str):
        n = _type(e).__name__
        return _str.__repr__(n[:80] if _type(n) is _str else "?")

    for res, lim in zip((resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE,
                         resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC), limits):
        resource.setrlimit(res, (lim, lim))
    if audit:
        sys.addaudithook(_guard)
    try:
        ns = {"__name__": "solution"}
        exec(compile(source, "<solution>", "exec"), ns)
        fn = ns[entry]
        out = []
        for args in calls:
            try:
                out.append("('ok'," + _literal(fn(*args)) + ")")
            except BaseException as e:
                out.append("('error'," + _name(e) + ")")
        text = "('ok',[" + _join(out) + "])"
    except BaseException as e:
        text = "('error'," + _name(e) + ")"
    payload = text.encode()
    frame = b"\n" + token + b" " + _str(_len(payload)).encode() + b"\n" + payload
    while frame:
        frame = frame[_write(1, frame):]
    _exit(0)

_main()
"""


@dataclass
class SandboxResult:
    """What came back from one sandboxed run."""

    status: str
    """"ok" (the harness reported), "error" (the code failed to load), "timeout", or "crashed"."""
    outputs: list[tuple[str, Any]]
    """Per call: ("ok", value) or ("error", exception name). Empty unless status is "ok"."""
    detail: str = ""


def _crashed(why: str) -> SandboxResult:
    return SandboxResult("crashed", [], why)


def _parse(data: bytes, token: bytes, n_calls: int) -> SandboxResult:
    """The harness's frame from the child's stdout, checked for shape; never raises."""
    head = b"\n" + token + b" "
    start = data.find(head)
    if start < 0:
        return _crashed("no result frame")
    size_end = data.find(b"\n", start + len(head))
    size = data[start + len(head) : size_end]
    if size_end < 0 or not size.isdigit() or len(size) > 12:
        return _crashed("bad result header")
    payload = data[size_end + 1 : size_end + 1 + int(size)]
    if len(payload) != int(size):
        return _crashed("truncated result")
    try:
        report = ast.literal_eval(payload.decode("utf-8"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError) as e:
        return _crashed(f"unparseable result: {type(e).__name__}")
    return _checked(report, n_calls)


def _checked(report: Any, n_calls: int) -> SandboxResult:
    """A SandboxResult from a parsed report, or "crashed" when it has the wrong shape."""
    if not (isinstance(report, tuple) and len(report) == 2):
        return _crashed("malformed result")
    status, payload = report
    if status == "error" and isinstance(payload, str):
        return SandboxResult("error", [], payload)
    if status != "ok" or not isinstance(payload, list) or len(payload) != n_calls:
        return _crashed("malformed result")
    for item in payload:
        if not (isinstance(item, tuple) and len(item) == 2 and item[0] in ("ok", "error")):
            return _crashed("malformed result")
        if item[0] == "error" and not isinstance(item[1], str):
            return _crashed("malformed result")
    return SandboxResult("ok", payload)


def run_sandboxed(
    source: str,
    entry: str,
    calls: list[tuple[Any, ...]],
    timeout_s: float = 2.0,
    cpu_s: float = 1.0,
    memory_mb: int = 256,
    output_kb: int = 256,
    isolation: str = "bwrap",
    audit_hook: bool = True,
    allow_root: bool = False,
) -> SandboxResult:
    """Exec source in a sandbox, call its function `entry` on each argument tuple, return the results.

    calls must hold only Python literals (ints, strings, lists, ...). isolation is "bwrap" or,
    knowingly weaker, "none" (see the module docstring); audit_hook=False removes the inner layer
    (tests use it to show the outer one holds alone). A root trainer's sandbox runs as uid 65534; where
    that cannot work it refuses unless allow_root=True. Raises SandboxUnavailable when the isolation
    cannot be set up; never raises for anything the code does.
    """
    require_isolation(isolation, allow_root)
    token = secrets.token_hex(16).encode()
    limits = (max(1, math.ceil(cpu_s)), memory_mb << 20, output_kb << 10, 0, 16, 0)
    job = marshal.dumps((source, entry, [tuple(c) for c in calls], token, limits, audit_hook))
    with tempfile.TemporaryDirectory(prefix="tl-sandbox-") as root:
        try:
            data, status = _launch(job, root, isolation, allow_root, timeout_s, output_kb << 10)
        except OSError as e:
            return _crashed(f"could not start the sandbox: {e!r}")
    if status == "timeout":
        return SandboxResult("timeout", [], f"exceeded {timeout_s} s")
    result = _parse(data, token, len(calls))
    if result.status == "crashed":
        result.detail += f" ({status})"
    return result


def _launch(
    job: bytes, root: str, isolation: str, allow_root: bool, timeout_s: float, max_bytes: int
) -> tuple[bytes, str]:
    """Run the harness on job; return (the first max_bytes of its stdout, "exit code N" or "timeout")."""
    cwd = os.path.join(root, "cwd")
    os.mkdir(cwd)
    with open(os.path.join(root, "stdout"), "w+b") as out:
        if isolation == "none":
            status = _wait(_spawn([sys.executable], out, cwd, ()), job, timeout_s, -1)
        else:
            status = _launch_bwrap(job, out, timeout_s, allow_root)
        out.seek(0)
        return out.read(max_bytes), status


def _launch_bwrap(job: bytes, out: BinaryIO, timeout_s: float, allow_root: bool) -> str:
    """The harness under bwrap: the seccomp program goes in on a memfd, the namespace's pid comes back on a pipe."""
    seccomp = os.memfd_create("tl-seccomp")
    r_info, w_info = os.pipe()
    try:
        os.write(seccomp, seccomp_filter())
        os.lseek(seccomp, 0, os.SEEK_SET)
        launch = launch_for(allow_root)
        argv = bwrap_argv(seccomp, w_info, launch) + [interpreter()[0]]
        proc = _spawn(argv, out, "/", (seccomp, w_info), launch.popen_kwargs())
        os.close(w_info)
        w_info = -1  # bwrap holds the only write end now, so its exit shows as EOF
        return _wait(proc, job, timeout_s, r_info)
    finally:
        for fd in (seccomp, r_info, w_info):
            if fd >= 0:
                os.close(fd)


def _spawn(
    command: list[str], out: BinaryIO, cwd: str, fds: tuple[int, ...], user: dict[str, Any] | None = None
) -> subprocess.Popen[bytes]:
    """Start `command -I -S -c HARNESS` in a new session with an empty environment, stdout to out."""
    return subprocess.Popen(
        command + ["-I", "-S", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL,
        cwd=cwd, env={}, start_new_session=True, pass_fds=fds, **(user or {}),
    )  # fmt: skip


def _wait(proc: subprocess.Popen[bytes], job: bytes, timeout_s: float, info_fd: int) -> str:
    """Feed the job, wait up to timeout_s, then make sure every process of the sandbox is gone.

    The namespace's init is pinned (pidfd) before the job is sent: the harness blocks on its stdin until
    then, so init is alive when pinned and the pidfd can never name a recycled pid. The clock starts once
    bwrap has set the namespaces up (it gets STARTUP_S for that), so a loaded machine does not eat it.
    """
    init = -1
    try:
        if info_fd >= 0:
            init = _pin_namespace_init(info_fd, STARTUP_S)
        proc.communicate(job, timeout=timeout_s)
        return f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        _kill_tree(proc, init)


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether fd becomes readable (or hung up) within timeout_s. poll, not select: select cannot watch
    an fd numbered 1024 or more, which a trainer holding many files hands out."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def _pin_namespace_init(info_fd: int, timeout_s: float) -> int:
    """A pidfd of the sandbox's PID-namespace init, or -1: bwrap's --info-fd JSON, which can arrive in pieces."""
    deadline, info = time.monotonic() + timeout_s, b""
    while _readable(info_fd, deadline - time.monotonic()):
        chunk = os.read(info_fd, 4096)
        if not chunk:
            return -1
        info += chunk
        try:
            doc = json.loads(info)
        except ValueError:
            continue  # not the whole document yet
        pid = doc.get("child-pid") if isinstance(doc, dict) else None
        try:
            return os.pidfd_open(pid) if isinstance(pid, int) and pid > 1 else -1
        except OSError:
            return -1
    return -1


def _kill_tree(proc: subprocess.Popen[bytes], init: int) -> None:
    """SIGKILL the namespace's init (the kernel then kills every process in it) and wait until it has
    exited, which the kernel signals only once the namespace is empty; then reap the child."""
    if init >= 0:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            _readable(init, 5.0)
            os.close(init)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
