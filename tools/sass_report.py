"""Compile the FP4 GEMM kernels for sm_90 without a GPU and summarise their SASS (spills, MMA kind, op mix).

Run: python tools/sass_report.py [--out DIR] [--cases gate_up down] [--set BLOCK_K=64]
(needs only triton's bundled ptxas / cuobjdump; to see what the GPU image's triton 3.6 emits, put that wheel
first on the path: pip install --no-deps --target /tmp/t36 triton==3.6.0; PYTHONPATH=/tmp/t36 python ...)
Answers what the device benchmarks cannot say cheaply: does a config spill to local memory (LDL/STL),
does the MMA use Hopper's wgmma (HGMMA) or the older HMMA path, how many instructions per weight element.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trace_lightning.kernels.kv import _attn_split_kernel
from trace_lightning.kernels.linear import _linear_kernel
from trace_lightning.kernels.moe import _down_kernel, _gate_up_kernel
from trace_lightning.kernels.quantize import _mxfp4_kernel, _nvfp4_kernel
from trace_lightning.kernels.router import _route_topk_kernel

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"ids_ptr": "*i64", "bexp_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "a_ptr": "*bf16",
       "g_ptr": "*fp32", "ag_ptr": "*fp32", "tw_ptr": "*bf16", "h_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32",
       "x_ptr": "*bf16", "q_ptr": "*bf16", "pos_ptr": "*i64", "kp": "*u8", "ks": "*u8", "kg": "*fp32", "vp": "*u8",
       "vs": "*u8", "vg": "*fp32", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sm_scale": "fp32",
       "packed_ptr": "*u8", "words_ptr": "*i32", "scales_ptr": "*u8", "dq_ptr": "*bf16", "logits_ptr": "*bf16",
       "gates_ptr": "*bf16"}
# int arguments that real launches pass as multiples of 16 (Triton specializes those as divisible by 16)
DIV16 = {"N", "K", "K_SPLIT", "D", "I", "S", "SPLIT_LEN", "E"}


def signature(fn, consts: dict) -> dict:  # noqa: ANN001
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else PTR.get(name, "i32")
    return sig


def sass_of(fn, consts: dict, warps: int, stages: int, out: Path, tag: str) -> dict:  # noqa: ANN001
    sig = signature(fn, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name in DIV16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    cubin = out / f"{tag}.cubin"
    cubin.write_bytes(k.asm["cubin"])
    (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    (out / f"{tag}.sass").write_text(sass)
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    order = [op.split(".")[0] for _, op in instructions(sass)]
    ops = collections.Counter(order)
    loop = loop_ops(sass)
    first_memory = next((i for i, op in enumerate(order) if op.startswith(GLOBAL_MEMORY_OPS)), len(order))
    return {"tag": tag, "regs": int(regs.group(1)) if regs else None, "shared": k.metadata.shared,
            "total": sum(ops.values()), "loop": sum(loop.values()),
            "loop_LDG": loop["LDG"], "loop_LDGSTS": loop["LDGSTS"],  # synchronous / cp.async global loads
            "loop_LDGSTS_16B": sum(n for op, n in loop_ops(sass, full=True).items()  # 16-byte cp.async
                                   if op.startswith("LDGSTS") and op.endswith(".128")),
            "LDL": ops["LDL"], "STL": ops["STL"],
            "HGMMA": ops["HGMMA"], "HMMA": ops["HMMA"], "LDG": ops["LDG"], "IMAD": ops["IMAD"], "LOP3": ops["LOP3"],
            "PRMT": ops["PRMT"], "FMUL": ops["FMUL"], "F2FP": ops["F2FP"],
            # programmatic dependent launch: griddepcontrol.wait / .launch_dependents, and whether the wait comes
            # before the kernel's first global load or store
            "ACQBULK": ops["ACQBULK"], "PREEXIT": ops["PREEXIT"],
            "waits_before_memory": "ACQBULK" in order[:first_memory]}


GLOBAL_MEMORY_OPS = ("LDG", "STG", "ATOM", "RED")  # SASS op names of global loads, cp.async, stores, atomics


def instructions(sass: str) -> list[tuple[int, str]]:
    pattern = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)"
    return [(int(a, 16), op) for a, op in re.findall(pattern, sass)]


def loop_ops(sass: str, full: bool = False) -> collections.Counter:
    """Op counts of the longest backward branch's body (the K / key loop), by op name or (full) with modifiers."""
    jumps = [(int(a, 16), int(t, 16)) for a, t in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", sass)]
    back = [(a, t) for a, t in jumps if t < a]
    if not back:
        return collections.Counter()
    end, start = max(back, key=lambda j: j[0] - j[1])
    return collections.Counter(op if full else op.split(".")[0] for addr, op in instructions(sass)
                               if start <= addr <= end)


CASES = {
    "gate_up": (_gate_up_kernel, {"DTYPE": tl.bfloat16, "PREC": "tf32", "FAST": 1, "WORDS": 0, "TILED": 0,
                                  "EVEN_K": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
    "down": (_down_kernel, {"QUANT_A": 1, "DTYPE": tl.bfloat16, "PREC": "tf32", "FAST": 1, "WORDS": 0,
                            "TILED": 0, "EVEN_K": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
    "linear": (_linear_kernel, {"DTYPE": tl.bfloat16, "PREC": "tf32", "SWAP": 1, "FAST": 1, "WORDS": 0,
                                "TILED": 0, "EVEN_K": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
    "attention": (_attn_split_kernel, {"G": 8, "DH": 128, "BLOCK_G": 8, "BLOCK_S": 64, "DTYPE": tl.bfloat16,
                                       "PREC": "tf32", "FAST": 1, "WORDS": 1, "TILES": 0}),
    # the quantizers at the benchmark's shape (K = 8192: one row per program, one pass; --warps 4 as launched, 8 for the
    # fake-quant / operand variants)
    "nvfp4_rows": (_nvfp4_kernel, {"GLOBAL": 2, "DEQUANT": 0, "ONE_PASS": 1, "BLOCK_R": 1,
                                   "BLOCK_K": 8192}),
    "nvfp4_rows_operand": (_nvfp4_kernel, {"GLOBAL": 2, "DEQUANT": 2, "ONE_PASS": 1, "BLOCK_R": 1,
                                           "BLOCK_K": 8192}),  # + the moe_down GEMM operand (bf16)
    "nvfp4_given": (_nvfp4_kernel, {"GLOBAL": 1, "DEQUANT": 0, "ONE_PASS": 1, "BLOCK_R": 1,
                                    "BLOCK_K": 8192}),  # a given global scale (weights)
    "nvfp4_weight_words": (_nvfp4_kernel, {"GLOBAL": 1, "DEQUANT": 0, "ONE_PASS": 1, "BLOCK_R": 1, "BLOCK_K": 8192,
                                           "WORDS": 1, "TILED": 1}),  # a weight sync's: the GEMMs' layout written
    "mxfp4_floor": (_mxfp4_kernel, {"RCEIL": 0, "BLOCK_R": 1, "BLOCK_K": 8192}),
    # the router's softmax + top-8 of 128 experts, as route_topk launches it (8 rows a program)
    "router": (_route_topk_kernel, {"SOFTMAX": 1, "NORMALIZE": 1, "TOP_K": 8, "BLOCK_K": 8, "ROWS": 8,
                                    "BLOCK_E": 128}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "sass")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], help="constexpr overrides, e.g. BLOCK_K=64 PDL=1")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"triton {triton.__version__}, sm_90, {args.warps} warps, {args.stages} stages")
    for name in args.cases:
        fn, consts = CASES[name]
        consts = {"PDL": 0, **consts}  # plain launches unless --set PDL=1 (programmatic dependent launch)
        if fn is _nvfp4_kernel:  # stored order unless the case says otherwise (constexprs, as launches pass them)
            consts = {"WORDS": 0, "TILED": 0, **consts}
        for kv in args.set:
            key, value = kv.split("=")
            if key in consts:
                consts[key] = int(value)
        print(sass_of(fn, consts, args.warps, args.stages, args.out, name))


if __name__ == "__main__":
    main()
