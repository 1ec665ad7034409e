"""Quantizer launch sweep: rows and warps a program for the benchmark's [16384, 8192] bf16 activation.

Run: python tools/sweep_quant.py   (CUDA only; median ms and % of the 4.25 TB/s copy ceiling, as bench_kernels.py)
The default is trace_lightning/kernels/quantize.py's _launch_shape; kernels.quantize.LAUNCH overrides it.
"""

from __future__ import annotations

import sys

import torch
from _bench import COPY_CEILING, bench_ms

from trace_lightning import kernels
from trace_lightning.kernels import quantize

SHAPES = [None, (1, 4), (1, 8), (1, 16), (1, 32), (2, 16), (2, 32)]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_quant needs a CUDA device")
    R, K = 16384, 8192
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    nv_out = R * K // 2 + R * K // 16 + 4 * R
    g = torch.tensor(0.01, device="cuda")
    cases = {
        "quantize_nvfp4_rows": (lambda: kernels.quantize_nvfp4_rows(x), x.nbytes + nv_out),
        # the scalar on the device: a Python float would be copied from the host on every call
        "quantize_nvfp4(scalar g)": (lambda: kernels.quantize_nvfp4(x, g), x.nbytes + nv_out - 4 * R),
        "fake_quantize_nvfp4_rows": (lambda: kernels.fake_quantize_nvfp4_rows(x), 2 * x.nbytes + nv_out),
        "quantize_mxfp4 floor": (lambda: kernels.quantize_mxfp4(x, "floor"), x.nbytes + R * K // 2 + R * K // 32),
    }
    for name, (fn, nbytes) in cases.items():
        results = []
        for shape in SHAPES:
            quantize.LAUNCH = shape
            try:
                ms = bench_ms(fn)
            except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                print(f"# {name} {shape}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((ms, shape))
        quantize.LAUNCH = None
        pct = [(ms, shape, nbytes / (ms * 1e-3) / COPY_CEILING * 100) for ms, shape in results]
        print(f"{name}: " + "; ".join(f"{shape or 'default'} {ms:.4f} ms {p:.1f}%" for ms, shape, p in pct), flush=True)


if __name__ == "__main__":
    main()
