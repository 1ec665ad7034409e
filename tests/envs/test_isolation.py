"""The seccomp program, run on a small classic-BPF interpreter: what it allows, refuses and kills."""

import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trace_lightning.envs import isolation, sandbox
from trace_lightning.envs.isolation import (
    AF_UNIX,
    ARCHES,
    DENIED,
    FORK_CALLS,
    SandboxUnavailable,
    _others_can_run,
    interpreter,
    seccomp_filter,
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


def _world_runnable_python() -> tuple[str, str] | None:
    """An interpreter of this Python version that uid 65534 can execute, with its prefix, or None."""
    if all(_others_can_run(p) for p in interpreter()):
        return interpreter()
    exe = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    return (exe, "/usr") if os.path.exists(exe) and _others_can_run(exe) else None


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


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to uid 65534 applies to root trainers")
def test_root_trainer_runs_the_sandbox_as_nobody_outside_too(monkeypatch: pytest.MonkeyPatch) -> None:
    python = _world_runnable_python()
    if python is None:
        pytest.skip("no interpreter of this version that uid 65534 can execute")
    monkeypatch.setattr(isolation, "interpreter", lambda: python)
    monkeypatch.setattr(sandbox, "interpreter", lambda: python)
    assert isolation.spawn_user() == {"user": 65534, "group": 65534, "extra_groups": []}
    found: set[str] = set()
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(sandbox.run_sandboxed, "import time\nf = lambda x: time.sleep(x) or x", "f", [(1.5,)], 5.0)
        deadline = time.monotonic() + 4.0
        while not found and time.monotonic() < deadline:
            found = _uids_below(os.getpid(), "python")
            time.sleep(0.05)
        assert run.result().outputs == [("ok", 1.5)]
    assert found == {"65534"}
