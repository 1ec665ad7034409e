"""The outer wall around model-written code: bubblewrap namespaces plus a seccomp filter.

The sandboxed interpreter runs under `bwrap` (Debian/Ubuntu package `bubblewrap`) in new user, PID,
network, IPC, UTS, cgroup and mount namespaces, as uid/gid 65534 with an empty capability bounding set
and no_new_privs (setuid binaries give nothing), on a root that holds only read-only binds of /usr and
the Python installation, a private size-capped /tmp, the /proc of its own PID namespace and a read-only
minimal /dev, with the root-only files of /proc (slabinfo, timer_list, vmallocinfo, kmsg, ...) masked.
The environment is cleared; it dies with its parent.

A root trainer starts bwrap as uid/gid 65534, so the sandbox is nobody outside its namespaces too. When
nobody cannot reach the interpreter (pyenv under a 0700 /root), util-linux's `unshare` first makes a
private mount namespace where the interpreter's directories are bound onto a directory nobody can
traverse, and `setpriv` drops to 65534 before bwrap runs. If no drop works, the sandbox refuses to
start unless the caller passes allow_root=True (then it runs as root outside its namespaces, without
any capability).

A seccomp filter (built here as classic BPF, no libseccomp needed) refuses process creation
(fork, vfork, clone, clone3: this is what stops fork bombs even when the trainer runs as root, where
the kernel ignores RLIMIT_NPROC), sockets of any family but AF_UNIX (no AF_INET, AF_NETLINK, AF_VSOCK,
AF_PACKET ...), and the kernel surfaces a verifier never needs: ptrace, pidfds, mount and namespace
calls, keyrings, bpf, io_uring, mknod, renice, re-pinning and friends.
"""

from __future__ import annotations

import atexit
import functools
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

BWRAP = "bwrap"
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`, Fedora: `dnf install bubblewrap`, "
    "Arch: `pacman -S bubblewrap`)"
)

SANDBOX_UID = 65534
TMP_BYTES = 16 << 20
MASKED_PROC = ("kcore", "kmsg", "kpagecgroup", "kpagecount", "kpageflags", "pagetypeinfo", "sched_debug",
               "slabinfo", "timer_list", "vmallocinfo", "mtrr", "sysrq-trigger")  # fmt: skip
"""/proc files covered by /dev/null in the sandbox (with every other top-level one only root may read)."""
ALLOW_ROOT_HINT = (
    "pass allow_root=True (a config's env_kwargs: {allow_root: true}) to run it as root outside its namespaces "
    "knowingly, or run the trainer as a non-root user"
)

# Syscalls refused with EPERM, by name; numbers per architecture (from the kernel's unistd headers).
DENIED = (
    "fork vfork clone clone3 ptrace process_vm_readv process_vm_writev pidfd_open pidfd_send_signal pidfd_getfd "
    "kcmp keyctl add_key request_key unshare setns mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick "
    "move_mount open_tree mount_setattr bpf perf_event_open userfaultfd io_uring_setup io_uring_enter "
    "io_uring_register kexec_load kexec_file_load init_module finit_module delete_module open_by_handle_at "
    "mknod mknodat acct swapon swapoff reboot syslog quotactl setpriority sched_setaffinity ioprio_set personality"
).split()
FORK_CALLS = frozenset(("fork", "vfork", "clone"))
"""What the runner (sandbox.py) needs to start each call's child; the child's own filter refuses them."""
SOCKET_CALLS = ("socket", "socketpair")
"""Calls whose first argument is an address family: only AF_UNIX passes."""
AF_UNIX = 1
_SOCKETS = {"x86_64": {"socket": 41, "socketpair": 53}, "aarch64": {"socket": 198, "socketpair": 199}}
_GENERIC = {"clone3": 435, "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "fsopen": 430,
            "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
            "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
_X86_64 = _GENERIC | {
    "fork": 57, "vfork": 58, "clone": 56, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "kcmp": 312, "keyctl": 250, "add_key": 248, "request_key": 249, "unshare": 272, "setns": 308, "mount": 165,
    "umount2": 166, "pivot_root": 155, "chroot": 161, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "open_by_handle_at": 304, "mknod": 133, "mknodat": 259, "acct": 163, "swapon": 167, "swapoff": 168,
    "reboot": 169, "syslog": 103, "quotactl": 179, "setpriority": 141, "sched_setaffinity": 203,
    "ioprio_set": 251, "personality": 135,
}
_AARCH64 = _GENERIC | {
    "clone": 220, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "keyctl": 219,
    "add_key": 217, "request_key": 218, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
    "pivot_root": 41, "chroot": 51, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "open_by_handle_at": 265, "mknodat": 33, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142,
    "syslog": 116, "quotactl": 60, "setpriority": 140, "sched_setaffinity": 122, "ioprio_set": 30,
    "personality": 92,
}
# machine -> (AUDIT_ARCH_* value, syscall numbers, first number of a foreign ABI sharing the arch or None)
ARCHES = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}

_LD_ABS_W, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low 32 bits on little-endian)
_ALLOW, _KILL_PROCESS, _ERRNO_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1


class SandboxUnavailable(RuntimeError):
    """The isolation the caller asked for cannot be set up on this machine."""


def seccomp_filter(machine: str | None = None, allow_fork: bool = False) -> bytes:
    """A classic-BPF seccomp program (struct sock_filter[]) that refuses DENIED, and sockets of any family
    but AF_UNIX, with EPERM.

    allow_fork lets fork / vfork / clone through (the runner's filter; clone3 stays refused). A foreign
    architecture (e.g. 32-bit syscalls) kills the process, since the numbers would not match.
    """
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SandboxUnavailable(f"no seccomp syscall table for architecture {machine!r}; known: {sorted(ARCHES)}")
    arch, numbers, foreign_abi = ARCHES[machine]
    denied = {name for name in DENIED if name in numbers and not (allow_fork and name in FORK_CALLS)}
    # (op, k, jump-if-true label, jump-if-false label); None falls through. Jumps go forward only.
    code: list[tuple[int, int, str | None, str | None]] = [(_LD_ABS_W, _ARCH, None, None),
                                                           (_JEQ, arch, None, "kill"), (_LD_ABS_W, _NR, None, None)]
    if foreign_abi is not None:
        code.append((_JGE, foreign_abi, "eperm", None))
    code += [(_JEQ, nr, "eperm", None) for nr in sorted(numbers[name] for name in denied)]
    code += [(_JEQ, _SOCKETS[machine][name], "family", None) for name in SOCKET_CALLS]
    labels = {"allow": len(code)}
    code.append((_RET, _ALLOW, None, None))
    labels["family"] = len(code)
    code += [(_LD_ABS_W, _ARG0, None, None), (_JEQ, AF_UNIX, "allow_unix", "eperm")]
    labels["allow_unix"] = len(code)
    code.append((_RET, _ALLOW, None, None))
    labels["eperm"] = len(code)
    code.append((_RET, _ERRNO_EPERM, None, None))
    labels["kill"] = len(code)
    code.append((_RET, _KILL_PROCESS, None, None))

    def offset(pc: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - pc - 1

    return b"".join(
        struct.pack("<HBBI", op, offset(pc, jt), offset(pc, jf), k) for pc, (op, k, jt, jf) in enumerate(code)
    )


def interpreter() -> tuple[str, str]:
    """The real (symlink-free) Python executable and the installation prefix that holds its stdlib."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _others_can_run(path: str) -> bool:
    """Whether a user with no special access can reach and execute path (o+x on it and every parent)."""
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


@dataclass(frozen=True)
class Launch:
    """How the trainer starts bwrap: a command before it, Popen's user arguments, and where bwrap finds the
    interpreter's directories (sandbox path -> path bwrap reads)."""

    prefix: tuple[str, ...] = ()
    user: tuple[tuple[str, Any], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()
    outside_uid: int = -1
    """The sandbox's uid outside its namespaces."""

    def popen_kwargs(self) -> dict[str, Any]:
        return dict(self.user)


_AS_NOBODY = (("user", SANDBOX_UID), ("group", SANDBOX_UID), ("extra_groups", []))
# Run by `unshare -m` as root: bind each source onto its private mount point, then drop to 65534 and exec bwrap.
_BIND_AND_DROP = (
    'while [ "$1" != -- ]; do mount --bind -o ro "$1" "$2" || exit 125; shift 2; done; shift; '
    f"exec setpriv --reuid {SANDBOX_UID} --regid {SANDBOX_UID} --clear-groups -- \"$@\""
)


def _bound_dirs() -> list[str]:
    """The interpreter's directories bwrap binds (those /usr does not already cover)."""
    exe, prefix = interpreter()
    bound: list[str] = []
    for path in (prefix, os.path.dirname(exe)):
        if not any(os.path.commonpath([path, root]) == root for root in ["/usr", *bound]):
            bound.append(path)
    return bound


@functools.cache
def _mount_points(n: int) -> tuple[str, ...]:
    """n empty directories nobody can traverse; in the private mount namespace they show the interpreter."""
    base = tempfile.mkdtemp(prefix="tl-sandbox-python-")
    os.chmod(base, 0o755)
    points = tuple(os.path.join(base, str(i)) for i in range(n))
    for point in points:
        os.mkdir(point, 0o755)
    atexit.register(shutil.rmtree, base, True)
    return points


def _drop_launch() -> Launch | None:
    """A launch that runs bwrap as uid 65534 (root trainers only), or None when util-linux is missing."""
    dirs = _bound_dirs()
    if all(_others_can_run(p) for p in interpreter()):
        return Launch(user=_AS_NOBODY, sources=tuple((d, d) for d in dirs), outside_uid=SANDBOX_UID)
    if shutil.which("unshare") is None or shutil.which("setpriv") is None or shutil.which("mount") is None:
        return None
    points = _mount_points(len(dirs))
    binds = [arg for d, point in zip(dirs, points, strict=True) for arg in (d, point)]
    prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", _BIND_AND_DROP, "sh", *binds, "--")
    return Launch(prefix=prefix, sources=tuple(zip(dirs, points, strict=True)), outside_uid=SANDBOX_UID)


def _plain_launch() -> Launch:
    """bwrap as the trainer's own uid."""
    return Launch(sources=tuple((d, d) for d in _bound_dirs()), outside_uid=os.geteuid())


def _root_binds(launch: Launch) -> list[str]:
    """ro-binds (or symlinks, where the host has merged /usr) of the system dirs an interpreter loads from."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for dest, source in launch.sources:
        args += ["--ro-bind", source, dest]
    return args


@functools.cache
def _masked_proc() -> tuple[str, ...]:
    """MASKED_PROC and every other top-level /proc file others may not read, those that exist here."""
    names = set(MASKED_PROC)
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name[0].isdigit() and entry.is_file(follow_symlinks=False):
                if not entry.stat(follow_symlinks=False).st_mode & stat.S_IROTH:
                    names.add(entry.name)
    return tuple(sorted(n for n in names if os.path.lexists(f"/proc/{n}")))


def bwrap_argv(seccomp_fd: int, info_fd: int, launch: Launch | None = None) -> list[str]:
    """The command line up to (not including) the sandboxed command: launch's prefix, then bwrap."""
    launch = launch or _plain_launch()
    masks = [arg for name in _masked_proc() for arg in ("--ro-bind", "/dev/null", f"/proc/{name}")]
    return [
        *launch.prefix, BWRAP,
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL", "--as-pid-1",
        *_root_binds(launch),
        "--proc", "/proc", *masks, "--dev", "/dev", "--remount-ro", "/dev",
        "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
        "--remount-ro", "/", "--chdir", "/tmp",
        "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd),
        "--",
    ]  # fmt: skip


def _probe(launch: Launch) -> str | None:
    """Why bwrap cannot run a sandboxed Python through launch, or None when it can."""
    r_info, w_info = os.pipe()
    seccomp = os.memfd_create("tl-seccomp")
    try:
        os.write(seccomp, seccomp_filter(allow_fork=True))
        os.lseek(seccomp, 0, os.SEEK_SET)
        argv = bwrap_argv(seccomp, w_info, launch) + [interpreter()[0], "-I", "-S", "-c", "pass"]
        proc = subprocess.run(
            argv, pass_fds=(seccomp, w_info), capture_output=True, timeout=30, check=False, cwd="/",
            **launch.popen_kwargs(),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{BWRAP}` could not run a sandboxed Python: {e!r}"
    finally:
        for fd in (r_info, w_info, seccomp):
            os.close(fd)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[:300]
        return f"`{BWRAP}` is installed but could not run a sandboxed Python (exit {proc.returncode}): {err}"
    return None


@functools.cache
def bwrap_problem() -> str | None:
    """Why bwrap cannot isolate code here (missing, or namespaces refused), or None when it works."""
    if shutil.which(BWRAP) is None:
        return f"the `{BWRAP}` executable was not found on PATH; {INSTALL_HINT}"
    try:
        seccomp_filter()
    except SandboxUnavailable as e:
        return str(e)
    return _probe(_plain_launch())


@functools.cache
def _drop() -> tuple[Launch | None, str]:
    """For a root trainer: a working launch as uid 65534, or None and why none works."""
    launch = _drop_launch()
    if launch is None:
        return None, "util-linux's unshare, setpriv and mount are needed to reach the interpreter as nobody"
    problem = _probe(launch)
    return (None, problem) if problem else (launch, "")


def launch_for(allow_root: bool) -> Launch:
    """How to start bwrap: as uid 65534 when the trainer is root (or, with allow_root, as root when that
    cannot work), as the trainer's uid otherwise. Raises SandboxUnavailable naming allow_root."""
    if os.geteuid() != 0:
        return _plain_launch()
    launch, why = _drop()
    if launch is not None:
        return launch
    if allow_root:
        return _plain_launch()
    raise SandboxUnavailable(
        f"the trainer runs as root and the sandbox cannot drop to uid {SANDBOX_UID} ({why}), so model-written "
        f"code would run as root outside its namespaces; {ALLOW_ROOT_HINT}"
    )


def require_isolation(isolation: str, allow_root: bool = False) -> None:
    """Raise SandboxUnavailable unless `isolation` ("bwrap" or the explicit weaker "none") can be used.

    With "bwrap" and a root trainer, the sandbox must drop to uid 65534 unless allow_root is True.
    """
    if isolation == "none":
        return
    if isolation != "bwrap":
        raise ValueError(f"unknown isolation {isolation!r}; use 'bwrap' or, knowingly weaker, 'none'")
    problem = bwrap_problem()
    if problem is not None:
        raise SandboxUnavailable(
            f"model-written code runs under bubblewrap, which is unusable here: {problem}. "
            "To run it without namespaces (rlimits and an audit hook only; not safe against hostile code), "
            "pass isolation='none' explicitly."
        )
    launch_for(allow_root)
