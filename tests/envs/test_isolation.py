"""The seccomp program, run on a small classic-BPF interpreter: what it allows, refuses and kills."""

import os
import shutil
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trace_lightning.envs import CodingEnv, Problem, isolation, sandbox
from trace_lightning.envs.isolation import (
    AF_UNIX,
    ARCHES,
    DENIED,
    FORK_CALLS,
    SandboxUnavailable,
    seccomp_filter,
)

AFFINE = Problem(
    prompt="f(0)=3;f(1)=5;f(2)=7\nf=lambda x:",
    answer="2*x+3",
    metadata={"kind": "int", "tests": [[0], [1], [2], [10], [-4]], "expected": [3, 5, 7, 23, -5]},
)
ALLOW, EPERM, KILL = 0x7FFF0000, 0x00050001, 0x80000000
# Calls that exist on every architecture here and that the interpreter needs.
NEEDED = {"x86_64": {"read": 0, "write": 1, "mmap": 9, "execve": 59, "exit_group": 231},
          "aarch64": {"read": 63, "write": 64, "mmap": 222, "execve": 221, "exit_group": 94}}  # fmt: skip


def run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """Evaluate a seccomp classic-BPF program on seccomp_data {nr, arch, ip, args[0]} (only the opcodes it uses)."""
    data = struct.pack("<iIQQ", nr, arch, 0, arg0)
    insns = [struct.unpack_from("<HBBI", program, off) for off in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code in (0x15, 0x35):  # jeq / jge
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_denied_calls_get_eperm_others_pass_foreign_arch_is_killed(machine: str) -> None:
    arch, numbers, foreign_abi = ARCHES[machine]
    program = seccomp_filter(machine)
    for name in DENIED:
        if name in numbers:
            assert run_bpf(program, numbers[name], arch) == EPERM, name
    for name, nr in NEEDED[machine].items():
        assert run_bpf(program, nr, arch) == ALLOW, name
    assert run_bpf(program, numbers["clone"], 0x40000003) == KILL  # i386
    if foreign_abi is not None:  # x32 calls share the arch value: refused whatever the number
        assert run_bpf(program, foreign_abi | NEEDED[machine]["read"], arch) == EPERM


SOCKETS = {"x86_64": (41, 53), "aarch64": (198, 199)}  # socket, socketpair (kernel unistd headers)
FAMILIES = {"AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17, "AF_VSOCK": 40, "AF_BLUETOOTH": 31}


@pytest.mark.parametrize("machine", sorted(ARCHES))
@pytest.mark.parametrize("allow_fork", [False, True])
def test_only_unix_sockets_pass(machine: str, allow_fork: bool) -> None:
    arch = ARCHES[machine][0]
    program = seccomp_filter(machine, allow_fork=allow_fork)
    for nr in SOCKETS[machine]:
        assert run_bpf(program, nr, arch, AF_UNIX) == ALLOW
        for name, family in FAMILIES.items():
            assert run_bpf(program, nr, arch, family) == EPERM, (nr, name)
        assert run_bpf(program, nr, arch, (1 << 32) | 2) == EPERM  # the kernel reads an int: high bits change nothing


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_the_runner_filter_lets_only_fork_through(machine: str) -> None:
    arch, numbers, _ = ARCHES[machine]
    runner, child = seccomp_filter(machine, allow_fork=True), seccomp_filter(machine)
    for name in DENIED:
        if name in numbers:
            want = ALLOW if name in FORK_CALLS else EPERM
            assert run_bpf(runner, numbers[name], arch) == want, name
            assert run_bpf(child, numbers[name], arch) == EPERM, name
    assert "clone3" not in FORK_CALLS


def test_syscall_tables_name_only_denied_calls_and_miss_only_legacy_ones() -> None:
    for machine, (_, numbers, _) in ARCHES.items():
        assert set(numbers) <= set(DENIED), machine
        assert set(DENIED) - set(numbers) <= {"fork", "vfork", "mknod"}, machine  # absent on asm-generic arches
        assert len(set(numbers.values())) == len(numbers), f"{machine}: two calls share a number"


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(SandboxUnavailable, match="no seccomp syscall table for architecture 'riscv64'"):
        seccomp_filter("riscv64")


def _uids_below(root: int, comm_prefix: str) -> set[str]:
    """The real/effective/saved/fs uids of processes below root whose name starts with comm_prefix."""
    uids: set[str] = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if fields["Name"].strip().startswith(comm_prefix) and int(fields["PPid"]) != 0:
            pid = int(status.parent.name)
            if pid != root and root in _ancestors(pid):
                uids |= set(fields["Uid"].split())
    return uids


def _ancestors(pid: int) -> set[int]:
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen | {pid}


def _outside_uids_while_running(**kwargs: object) -> tuple[set[str], sandbox.SandboxResult]:
    """The host uids of the sandbox's Python processes, seen from here while one runs, and its result."""
    found: set[str] = set()
    with ThreadPoolExecutor(1) as pool:
        code = "import time\nf = lambda x: time.sleep(x) or x"
        run = pool.submit(sandbox.run_sandboxed, code, "f", [(1.5,)], 5.0, **kwargs)
        deadline = time.monotonic() + 4.0
        while not found and time.monotonic() < deadline:
            found = _uids_below(os.getpid(), "python")
            time.sleep(0.05)
        return found, run.result()


@pytest.fixture
def fresh_probes() -> Iterator[None]:
    """The availability probes are cached per process: start and end each test with them cleared."""
    for probe in (isolation.bwrap_problem, isolation._drop):
        probe.cache_clear()
    yield
    for probe in (isolation.bwrap_problem, isolation._drop):
        probe.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to uid 65534 applies to root trainers")
@pytest.mark.usefixtures("fresh_probes")
def test_root_trainer_runs_the_sandbox_as_nobody_outside_too() -> None:
    """Also with this interpreter under a 0700 /root: a private mount namespace lets nobody reach it."""
    assert isolation.launch_for(allow_root=False).outside_uid == 65534
    found, result = _outside_uids_while_running()
    assert result.outputs == [("ok", 1.5)]
    assert found == {"65534"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to uid 65534 applies to root trainers")
@pytest.mark.usefixtures("fresh_probes")
def test_without_a_uid_drop_the_sandbox_refuses_unless_allow_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A PATH with bwrap but without util-linux (unshare, setpriv, mount): nobody cannot reach this
    interpreter under a 0700 /root then, so no drop works (with a world-runnable one it would)."""
    if all(isolation._others_can_run(p) for p in isolation.interpreter()):
        pytest.skip("nobody can run this interpreter directly: the drop needs no util-linux here")
    (tmp_path / "bwrap").symlink_to(shutil.which("bwrap") or "/usr/bin/bwrap")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"cannot drop to uid 65534 .*allow_root=True.*allow_root: true"):
        CodingEnv()
    with pytest.raises(SandboxUnavailable, match="allow_root"):
        sandbox.run_sandboxed("f = abs", "f", [(1,)])
    assert CodingEnv(allow_root=True).score(AFFINE, " 2*x+3") == 1.0
    found, result = _outside_uids_while_running(allow_root=True)
    assert result.outputs == [("ok", 1.5)] and found == {"0"}  # root outside, knowingly
    masked = "def f(x):\n    try:\n        return len(open('/proc/' + x).read())\n    except OSError as e:\n" \
        "        return type(e).__name__"
    names = ["slabinfo", "timer_list", "vmallocinfo", "kmsg", "pagetypeinfo", "version"]
    result = sandbox.run_sandboxed(masked, "f", [(n,) for n in names], audit_hook=False, allow_root=True)
    assert [v for _, v in result.outputs][:-1] == ["PermissionError"] * 5, result
    assert isinstance(result.outputs[-1][1], int) and result.outputs[-1][1] > 0  # world-readable files stay


def test_root_only_proc_files_are_masked() -> None:
    masks = isolation._masked_proc()
    assert {"slabinfo", "timer_list", "vmallocinfo"} <= set(masks) | {n for n in isolation.MASKED_PROC
                                                                        if not os.path.exists(f"/proc/{n}")}
    argv = isolation.bwrap_argv(3, 4)
    for name in masks:
        i = argv.index(f"/proc/{name}")
        assert argv[i - 2 : i] == ["--ro-bind", "/dev/null"], name
    assert argv.index("--proc") < argv.index(f"/proc/{masks[0]}")  # masks go on top of the new /proc
