"""The training fake-quant kernels compile for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel's Python, not its compiler: a kernel can pass every CPU test and still be refused
by the GPU compiler (a loop-carried variable whose shape changes in the loop did exactly that). Triton compiles for a
named target without a device, through to the cubin (its own ptxas), so each constexpr variant the wrappers launch is
compiled here, in a process without TRITON_INTERPRET (under it `triton.jit` gives interpreted functions).
"""

import os
import subprocess
import sys
import textwrap

_COMPILE = textwrap.dedent("""
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from trace_lightning.kernels import fake_quant as fq

    target = GPUTarget("cuda", 90, 32)
    record_sig = {"x_ptr": "*bf16", "data_ptr": "*u8", "ok_ptr": "*i8", "dq_ptr": "*bf16", "inside_ptr": "*i8",
                  "R": "i32", "K": "i32", "T": "i32", "stride_b": "i64", "stride_t": "i64", "g_off": "i32",
                  "s_off": "i32", "p_off": "i32"}
    names = ["ROWS", "HAS_GLOBAL", "PARITY", "PARITY_PAYLOAD", "OWN", "BLOCK_R", "BLOCK_K"]
    for rows, has_global, parity, payload, own in itertools.product((8,), (True, False), (True, False),
                                                                   (True, False), (0, 1, 2)):
        if payload and not parity:
            continue  # parity bits cannot round to full codes (refused by the wrapper)
        const = dict(zip(names, (rows, has_global, parity, payload, own, 4, 1024)))
        sig = {**record_sig, **{n: "constexpr" for n in names}}
        triton.compile(ASTSource(fq._record_guided_kernel, sig, const), target=target)
        print("compiled _record_guided_kernel", const)
    guided_sig = {"x_ptr": "*fp32", "words_ptr": "*i32", "scales_ptr": "*u8", "g_ptr": "*fp32", "dq_ptr": "*fp32",
                  "inside_ptr": "*i8", "R": "i32", "K": "i32", "HAS_GLOBAL": "constexpr", "PARITY": "constexpr",
                  "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"}
    for has_global, parity in itertools.product((True, False), (True, False)):
        const = {"HAS_GLOBAL": has_global, "PARITY": parity, "BLOCK_R": 8, "BLOCK_K": 512}
        triton.compile(ASTSource(fq._guided_kernel, guided_sig, const), target=target)
        print("compiled _guided_kernel", const)
""")


def test_fake_quant_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = done.stdout.splitlines()
    assert sum(line.startswith("compiled _record_guided_kernel") for line in compiled) == 2 * 9
    assert sum(line.startswith("compiled _guided_kernel") for line in compiled) == 4
