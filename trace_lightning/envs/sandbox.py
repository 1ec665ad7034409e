"""Run untrusted model code in a locked-down subprocess and return what its function computed.

Layers, outermost first; none is trusted alone:
- bubblewrap + seccomp (isolation.py): own user/PID/network/IPC/UTS/mount namespaces, uid 65534 (outside
  too, for a root trainer, or the sandbox refuses unless allow_root), a read-only root with only a private
  size-capped /tmp writable, root-only /proc files masked, no environment, only AF_UNIX sockets, no
  pidfd/ptrace/mount/mknod/renice syscalls. `isolation="none"` drops this layer, explicitly;
- a runner, `python -I -S` as pid 1 of the PID namespace (signals from inside it are dropped) and
  non-dumpable (its children cannot open its /proc/1/mem or /proc/1/fd), that forks one child per call;
- each child holds only /dev/null and a pipe to the runner as its stdout, loads a stricter seccomp
  program (no fork / vfork / clone / clone3 either), sets resource limits (CPU seconds: SIGXCPU ends a
  busy loop; address space: big allocations raise MemoryError; file size, no core dumps, a small fd
  table, no new processes) and installs an audit hook (PEP 578) that allows only the `compile` and
  `exec` events, then execs the code and calls its function once;
- a wall-clock timeout in the parent, counted from when bwrap has set the namespaces up, after which
  it kills the sandbox's PID namespace (the runner, so the kernel kills every process in it) and waits
  until it is gone.

Results: the child writes one frame, a Python literal built from exact builtin types (an object's own
__repr__ / __eq__ never runs), on its pipe; the runner reads at most output_kb of it and reports, on a
stdout no child ever holds, per call: the child's wait status, whether it overflowed, and its bytes.
The parent parses that report, takes each call's last frame (ast.literal_eval, never eval) and accepts
only what f could have returned (int, finite float, str, bool, None, list, tuple). So a call's result is
chosen by that call's child alone and can claim nothing f could not return there; expected outputs
never enter the sandbox: the parent compares. run_sandboxed never raises for anything the code does.
"""

from __future__ import annotations

import ast
import json
import marshal
import math
import os
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

# Run as `python -I -S -c _HARNESS`: the runner (pid 1 of the sandbox's PID namespace under bwrap). The job
# (source, calls, limits, the child's seccomp program) arrives on stdin. The runner forks one child per call;
# the child holds only a pipe as its stdout, locks itself down, runs the code and writes one frame on the pipe.
# Only the runner writes the report, on a stdout no child ever holds.
_HARNESS = r"""
import _signal, marshal, posix, resource, sys

def _guard(event, args, _allowed=frozenset(("compile", "exec"))):
    if event not in _allowed:
        raise PermissionError("sandbox refused " + event)

def _call(source, entry, args, limits, audit, lock, _write=posix.write, _exit=posix._exit, _type=type, _str=str,
          _inf=float("inf"), _int=int.__repr__, _float=float.__repr__, _srepr=str.__repr__):
    # In the child. Locals, not globals: the code can rebind __main__'s names, never these.
    def _literal(v, depth=0):
        t = _type(v)
        if depth > 30:
            raise ValueError("nested too deep")
        if t is int:
            return _int(v)
        if t is str:
            return _srepr(v)
        if t is bool or v is None:
            return "True" if v is True else "False" if v is False else "None"
        if t is float and -_inf < v < _inf:
            return _float(v)
        if t is list or t is tuple:
            body = ",".join([_literal(x, depth + 1) for x in v])
            return "[" + body + "]" if t is list else "(" + body + ",)"
        raise TypeError("not a plain literal")

    def _name(e):
        n = _type(e).__name__
        return _srepr(n[:80] if _type(n) is _str else "?")

    if lock is not None and lock() != 0:
        _exit(3)
    for name in [m for m in sys.modules if m == "_ctypes" or m.split(".")[0] == "ctypes"]:
        del sys.modules[name]
    for res, lim in zip((resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE,
                         resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC), limits):
        resource.setrlimit(res, (lim, lim))
    if audit:
        sys.addaudithook(_guard)
    text = "('load','?')"
    try:
        ns = {"__name__": "solution"}
        exec(compile(source, "<solution>", "exec"), ns)
        fn = ns[entry]
        try:
            text = "('ok'," + _literal(fn(*args)) + ")"
        except BaseException as e:
            text = "('error'," + _name(e) + ")"
    except BaseException as e:
        text = "('load'," + _name(e) + ")"
    frame = b"\n\x1e" + text.encode() + b"\n"
    while frame:
        frame = frame[_write(1, frame):]
    _exit(0)

def _locker(child_filter):
    # The runner makes itself non-dumpable (no /proc/1/mem, /proc/1/fd for its children) and returns
    # what each child calls to load its own seccomp program, stricter than the runner's.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        posix._exit(3)
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(child_filter, len(child_filter))
    prog = Prog(len(child_filter) // 8, ctypes.addressof(buf))
    return lambda: libc.prctl(22, 2, ctypes.byref(prog), 0, 0) if buf else -1  # PR_SET_SECCOMP, FILTER

def _main():
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # as pid 1, signals from inside the namespace then drop
    job = b""
    while True:
        chunk = posix.read(0, 65536)
        if not chunk:
            break
        job += chunk
    source, entry, calls, limits, audit, child_filter, cap = marshal.loads(job)
    lock = _locker(child_filter) if child_filter else None
    null = posix.open("/dev/null", posix.O_RDWR)
    report = []
    for args in calls:
        r, w = posix.pipe()
        pid = posix.fork()
        if pid == 0:
            posix.dup2(null, 0)
            posix.dup2(w, 1)
            posix.dup2(null, 2)
            posix.closerange(3, 1 << 20)
            _call(source, entry, args, limits, audit, lock)
            posix._exit(4)
        posix.close(w)
        got, over = b"", 0
        while True:
            chunk = posix.read(r, 65536)
            if not chunk:
                break
            if len(got) + len(chunk) > cap:
                over = 1
                posix.kill(pid, _signal.SIGKILL)
                break
            got += chunk
        posix.close(r)
        status = posix.waitpid(pid, 0)[1]
        report.append(b"%d %d %d\n" % (status, over, len(got)) + got)
    out = b"".join(report) + b"end\n"
    while out:
        out = out[posix.write(1, out):]
    posix._exit(0)

_main()
"""
_END = b"end\n"
_FRAME = b"\n\x1e"


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


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether value is what the harness's serializer can emit (so a frame claims nothing f could not return)."""
    if depth > 31:
        return False
    if type(value) in (int, str, bool) or value is None:
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    return False


def _call_result(status: int, over: int, body: bytes) -> tuple[str, Any]:
    """One call's ("ok", value) / ("error", name) / ("load", name) from its child's exit status and stdout."""
    if over:
        return ("error", "OutputLimit")
    if os.WIFSIGNALED(status):
        try:
            return ("error", signal.Signals(os.WTERMSIG(status)).name)
        except ValueError:
            return ("error", f"signal {os.WTERMSIG(status)}")
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return ("error", f"exit {os.WEXITSTATUS(status) if os.WIFEXITED(status) else status}")
    start = body.rfind(_FRAME)
    if start < 0 or not body.endswith(b"\n") or b"\n" in body[start + len(_FRAME) : -1]:
        return ("error", "NoResult")
    try:
        item = ast.literal_eval(body[start + len(_FRAME) : -1].decode("utf-8"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
        return ("error", "BadResult")
    if not (type(item) is tuple and len(item) == 2 and item[0] in ("ok", "error", "load")):
        return ("error", "BadResult")
    if item[0] == "ok" and _plain(item[1]) or item[0] != "ok" and type(item[1]) is str:
        return item
    return ("error", "BadResult")


def _parse(data: bytes, n_calls: int) -> SandboxResult:
    """The runner's report, one record per call ("<wait status> <over cap> <size>\\n" + the child's stdout)
    then "end"; never raises. Only the runner writes it: no child holds the runner's stdout."""
    pos, outputs = 0, []
    for _ in range(n_calls):
        eol = data.find(b"\n", pos)
        head = data[pos:eol].split(b" ") if eol >= 0 else []
        if len(head) != 3 or not all(h.isdigit() and len(h) <= 12 for h in head):
            return _crashed("bad record header")
        status, over, size = (int(h) for h in head)
        body = data[eol + 1 : eol + 1 + size]
        if len(body) != size:
            return _crashed("truncated record")
        outputs.append(_call_result(status, over, body))
        pos = eol + 1 + size
    if data[pos:] != _END:
        return _crashed("no end of report")
    for tag, name in outputs:
        if tag == "load":
            return SandboxResult("error", [], name)
    return SandboxResult("ok", outputs)


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

    calls must hold only Python literals (ints, strings, lists, ...). Each call runs in a fresh child with
    cpu_s CPU seconds, memory_mb of address space and output_kb of stdout; timeout_s bounds the whole
    run. isolation is "bwrap" or,
    knowingly weaker, "none" (see the module docstring); audit_hook=False removes the inner layer
    (tests use it to show the outer one holds alone). A root trainer's sandbox runs as uid 65534; where
    that cannot work it refuses unless allow_root=True. Raises SandboxUnavailable when the isolation
    cannot be set up; never raises for anything the code does.
    """
    require_isolation(isolation, allow_root)
    limits = (max(1, math.ceil(cpu_s)), memory_mb << 20, output_kb << 10, 0, 16, 0)
    child_filter = seccomp_filter() if isolation == "bwrap" else b""
    cap = output_kb << 10
    job = marshal.dumps((source, entry, [tuple(c) for c in calls], limits, audit_hook, child_filter, cap))
    with tempfile.TemporaryDirectory(prefix="tl-sandbox-") as root:
        try:
            data, status = _launch(job, root, isolation, allow_root, timeout_s, len(calls) * (cap + 64) + 64)
        except OSError as e:
            return _crashed(f"could not start the sandbox: {e!r}")
    if status == "timeout":
        return SandboxResult("timeout", [], f"exceeded {timeout_s} s")
    result = _parse(data, len(calls))
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
        os.write(seccomp, seccomp_filter(allow_fork=True))
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
