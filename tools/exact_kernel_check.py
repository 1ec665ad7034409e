"""GPU diagnosis of trace_exact's Triton kernels: which side of a mismatch is wrong, and what compiles cost.

  python tools/exact_kernel_check.py [--device cpu]   (cpu: under TRITON_INTERPRET=1, small shapes: the tool's test)

Prints, for small W4A4 products: the operands quantized on the GPU against the CPU's (codes, scales, globals), the
kernel against arith.fp4_matmul on the GPU and on the CPU, and against the kernel launched with float32 MMA operands
("ieee"); the decoders alone (E2M1 codes, E4M3 scale bytes) against torch's float8 dtype; and the tree kernel's
first-call (compile) and warm times at the engine's shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_lightning.exact import arith  # noqa: E402
from trace_lightning.exact.forward import quantize_rows  # noqa: E402
from trace_lightning.kernels import exact as ke  # noqa: E402
from trace_lightning.kernels._fp4 import e2m1_to_f16_scaled, e4m3_to_f32  # noqa: E402
from trace_lightning.quant import quantize_weight  # noqa: E402
from trace_lightning.quant.words import canonical  # noqa: E402
from trace_lightning.sim._weights import row_globals  # noqa: E402


def operands(P: int, N: int, K: int, device: str, seed: int = 0):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, K, generator=g) * torch.logspace(-3, 2, P)[:, None]
    x[0, :16] = 0.0  # an all-zero block, as the unit test has
    w = torch.randn(N, K, generator=g) * 0.05
    return quantize_rows(x.to(device)), quantize_weight(w.to(device), "nvfp4")


def reference(xq, wq) -> torch.Tensor:  # noqa: ANN001
    return arith.fp4_matmul(arith.fp4_integers(xq), arith.fp4_integers(wq), xq.global_scale.reshape(-1),
                            row_globals(wq))


def report(name: str, got: torch.Tensor, want: torch.Tensor) -> int:
    """Print how many values of `got` differ from `want` (bit for bit) and where; return that count."""
    got, want = got.cpu(), want.cpu()
    bad = got.view(torch.int32) != want.view(torch.int32)
    rows = sorted({int(i) for i in bad.nonzero()[:, 0]})
    where = bad.nonzero()[:4].tolist()
    pairs = [(got[tuple(i)].item(), want[tuple(i)].item()) for i in where]
    print(f"{name}: {int(bad.sum())}/{bad.numel()} differ; rows {rows[:12]}; at {where}: got, want {pairs}",
          flush=True)
    return int(bad.sum())


@triton.jit
def _decode_kernel(codes_ptr, bytes_ptr, e2m1_ptr, e2m1_bits_ptr, e4m3_ptr):
    i = tl.arange(0, 256)
    codes = tl.load(codes_ptr + i)
    tl.store(e2m1_ptr + i, ke._twice_e2m1(codes, tl.float16).to(tl.float32))
    tl.store(e2m1_bits_ptr + i, e2m1_to_f16_scaled(codes).to(tl.float32) * 32768.0)  # the FP4 GEMMs' fp16 bit trick
    tl.store(e4m3_ptr + i, e4m3_to_f32(tl.load(bytes_ptr + i).to(tl.int32)))


def decoders(device: str) -> int:
    codes = (torch.arange(256, device=device) % 16).to(torch.int32)
    b = torch.arange(256, device=device, dtype=torch.int32)
    e2m1, e2m1_bits, e4m3 = (torch.empty(256, device=device) for _ in range(3))
    _decode_kernel[(1,)](codes, b, e2m1, e2m1_bits, e4m3)
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device=device)
    report("2*E2M1 decode", e2m1, 2 * lut[codes.long()] + 0.0)  # integers: code 8 (-0) decodes to +0
    report("2*E2M1 decode, fp16 bits", e2m1_bits, 2 * lut[codes.long()])
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    ok = ~want.isnan()
    report("E4M3 decode", e4m3[ok], want[ok])
    return 0  # the decoders explain a failure; the kernels' own comparisons decide it


def gemms(device: str) -> int:
    """The default launch's differing products (what the engine and training run)."""
    failed = 0
    for P, N, K in [(5, 24, 64), (16, 64, 16), (19, 70, 160), (3, 9, 2080)]:
        xq, wq = operands(P, N, K, device)
        want = reference(xq, wq)
        xc, wc = operands(P, N, K, "cpu")
        for side, got, cpu in (("x", xq, xc), ("w", canonical(wq), canonical(wc))):
            report(f"[{P},{N},{K}] {side} codes {device} vs cpu", got.codes().float(), cpu.codes().float())
            report(f"[{P},{N},{K}] {side} scales {device} vs cpu", got.scales.float(), cpu.scales.float())
        report(f"[{P},{N},{K}] globals {device} vs cpu", torch.cat([xq.global_scale.reshape(-1), row_globals(wq)]),
               torch.cat([xc.global_scale.reshape(-1), row_globals(wc)]))
        report(f"[{P},{N},{K}] arith {device} vs arith cpu", want, reference(xc, wc))
        failed += report(f"[{P},{N},{K}] kernel (default: fp16 MMA)", ke.exact_fp4_gemm(xq, wq), want)
        ieee = ke.exact_fp4_gemm(xq, wq, dot=tl.float32, precision="ieee")
        report(f"[{P},{N},{K}] kernel (fp32 MMA, ieee)", ieee, want)
    return failed


TREE_SHAPES = {
    "cuda": [((1, 1, 64, 1024), (1, 1, 4096, 1024)), ((64, 8, 1, 128), (64, 2, 300, 128)),
             ((64, 8, 1, 300), (64, 2, 128, 300)), ((8, 8, 150, 128), (8, 2, 150, 128))],
    "cpu": [((2, 4, 3, 40), (2, 2, 5, 40))],
}
"""(a, b) shapes of exact_tree_bmm: the lm head, decode q.k and P.V, a prefill's q.k (a small one on the CPU)."""


def tree_times(device: str) -> int:
    failed = 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for shape in TREE_SHAPES[device]:
        a, b = torch.randn(*shape[0], device=device), torch.randn(*shape[1], device=device)
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            got = ke.exact_tree_bmm(a, b)
            sync()
            times.append(time.perf_counter() - t)
        failed += report(f"tree {shape}", got, arith.tree_bmm(a, b))
        print(f"tree {shape}: first {times[0]:.2f} s, then {times[-1] * 1e3:.2f} ms", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    """Run every part; 0 when the kernels as the engine launches them agree with the reference everywhere, else 1
    (so a GPU call can chain what needs them: `python3 tools/exact_kernel_check.py && ...`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    device = p.parse_args(argv).device
    failed, broken = 0, []
    for part in (decoders, gemms, tree_times):
        try:
            failed += part(device)
        except Exception as e:  # noqa: BLE001 - a diagnosis reports every part
            broken.append(part.__name__)
            print(f"{part.__name__}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    ok = failed == 0 and not broken
    print(f"verdict: {'the exact kernels agree with the reference' if ok else 'FAILED'} ({failed} values differ"
          f"{'; parts that raised: ' + ', '.join(broken) if broken else ''})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
