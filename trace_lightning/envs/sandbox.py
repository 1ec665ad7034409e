"""Run untrusted model code in a locked-down subprocess and return what its function computed.

Layers, each cheap, none trusted alone:
- a fresh `python -I -S` (isolated: no site-packages, no PYTHON* env vars, no user site), an empty
  environment and an empty temporary working directory;
- resource limits set in the child before the code runs: CPU seconds (SIGXCPU kills a busy loop),
  address space (big allocations raise MemoryError), file size (stdout goes to a size-capped file, so
  flooding it kills the child), no core dumps, a small fd table, no new processes for non-root users;
- an audit hook (PEP 578) installed just before the code is compiled that allows only the `compile` and
  `exec` events: every import of a module not already loaded, every open(), os.system / fork / exec /
  spawn / kill, socket use, ctypes, sys._getframe, gc introspection, setrlimit ... raises PermissionError;
- a wall-clock timeout in the parent that kills the child's whole process group (it runs in a new session);
- the parent compares results itself: the expected outputs never enter the sandbox, results come back
  as a Python literal after a marker line and are parsed with ast.literal_eval (never eval).

An audit hook is not a security boundary against a determined attacker with memory-corruption bugs; for
the policies trained here (and for hostile snippets in the tests) the layers together keep the runner safe.
"""

from __future__ import annotations

import ast
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

MARKER = "\x00__sandbox_results__:"

# Run by the child. Placeholders are filled with repr() literals; braces are doubled for str.format.
_HARNESS = """\
import resource, sys, posix
_write, _flush, _exit = sys.stdout.write, sys.stdout.flush, posix._exit
for _res, _lim in ((resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_AS, {mem}), (resource.RLIMIT_FSIZE, {fsize}),
                   (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 16), (resource.RLIMIT_NPROC, 0)):
    resource.setrlimit(_res, (_lim, _lim))
_SOURCE, _ENTRY, _CALLS = {source}, {entry}, {calls}
def _guard(event, args, _allowed=frozenset(("compile", "exec"))):
    if event not in _allowed:
        raise PermissionError("sandbox refused " + event)
sys.addaudithook(_guard)
try:
    _ns = {{"__name__": "solution"}}
    exec(compile(_SOURCE, "<solution>", "exec"), _ns)
    _fn = _ns[_ENTRY]
    _out = []
    for _args in _CALLS:
        try:
            _out.append(("ok", _fn(*_args)))
        except BaseException as _e:
            _out.append(("error", type(_e).__name__))
    _text = repr(("ok", _out))
except BaseException as _e:
    _text = repr(("error", type(_e).__name__))
_write({marker} + _text + "\\n")
_flush()
_exit(0)
"""


@dataclass
class SandboxResult:
    """What came back from one sandboxed run."""

    status: str
    """"ok" (the harness reported), "error" (the code failed to load), "timeout", or "crashed"."""
    outputs: list[tuple[str, Any]]
    """Per call: ("ok", value) or ("error", exception name). Empty unless status is "ok"."""
    detail: str = ""


def _parse(stdout: str) -> SandboxResult:
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(MARKER)), None)
    if line is None:
        return SandboxResult("crashed", [], "no result line")
    try:
        status, payload = ast.literal_eval(line[len(MARKER) :])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        return SandboxResult("crashed", [], f"unparseable result: {type(e).__name__}")
    if status != "ok":
        return SandboxResult("error", [], str(payload))
    return SandboxResult("ok", list(payload))


def run_sandboxed(
    source: str,
    entry: str,
    calls: list[tuple[Any, ...]],
    timeout_s: float = 2.0,
    cpu_s: float = 1.0,
    memory_mb: int = 256,
    output_kb: int = 256,
) -> SandboxResult:
    """Exec source in a sandbox, call its function `entry` on each argument tuple, return the results.

    calls must hold only Python literals (ints, strings, lists, ...). Never raises for anything the code does.
    """
    harness = _HARNESS.format(
        cpu=max(1, math.ceil(cpu_s)),
        mem=memory_mb << 20,
        fsize=output_kb << 10,
        source=repr(source),
        entry=repr(entry),
        calls=repr([tuple(c) for c in calls]),
        marker=repr(MARKER),
    )
    with tempfile.TemporaryDirectory(prefix="tl-sandbox-") as root:
        cwd = os.path.join(root, "cwd")
        os.mkdir(cwd)
        with open(os.path.join(root, "stdout"), "w+b") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-"],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.DEVNULL,
                cwd=cwd,
                env={},
                start_new_session=True,
            )
            try:
                proc.communicate(harness.encode(), timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            if timed_out:
                return SandboxResult("timeout", [], f"exceeded {timeout_s} s")
            out.seek(0)
            stdout = out.read(output_kb << 10).decode("utf-8", errors="replace")
    result = _parse(stdout)
    if result.status == "crashed":
        result.detail += f" (exit code {proc.returncode})"
    return result


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (anything it spawned too) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
