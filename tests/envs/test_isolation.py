"""The seccomp program, run on a small classic-BPF interpreter: what it allows, refuses and kills."""

import struct

import pytest

from trace_lightning.envs.isolation import ARCHES, DENIED, SandboxUnavailable, seccomp_filter

ALLOW, EPERM, KILL = 0x7FFF0000, 0x00050001, 0x80000000
# Calls that exist on every architecture here and that the interpreter needs.
NEEDED = {"x86_64": {"read": 0, "write": 1, "mmap": 9, "execve": 59, "exit_group": 231},
          "aarch64": {"read": 63, "write": 64, "mmap": 222, "execve": 221, "exit_group": 94}}  # fmt: skip


def run_bpf(program: bytes, nr: int, arch: int) -> int:
    """Evaluate a seccomp classic-BPF program on seccomp_data {nr, arch} (only the opcodes it uses)."""
    data = struct.pack("<iI", nr, arch)
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


def test_syscall_tables_name_only_denied_calls_and_miss_only_legacy_ones() -> None:
    for machine, (_, numbers, _) in ARCHES.items():
        assert set(numbers) <= set(DENIED), machine
        assert set(DENIED) - set(numbers) <= {"fork", "vfork", "mknod"}, machine  # absent on asm-generic arches
        assert len(set(numbers.values())) == len(numbers), f"{machine}: two calls share a number"


def test_unknown_architecture_is_refused_by_name() -> None:
    with pytest.raises(SandboxUnavailable, match="no seccomp syscall table for architecture 'riscv64'"):
        seccomp_filter("riscv64")
