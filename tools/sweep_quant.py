"""Quantizer launch sweep: rows and warps a program for bench_kernels.py's [16384, 8192] bf16 activation.

Run: python tools/sweep_quant.py   (CUDA only; graph-replayed median ms and % of the 4.25 TB/s copy ceiling)
The default is trace_lightning/kernels/quantize.py's _launch_shape; KernelOptions.quantize overrides it.
"""

from __future__ import annotations

import sys

import torch
from _bench import COPY_CEILING, graph_ms
from bench_kernels import QUANT_SHAPE, quantizer_cases

from trace_lightning import kernels

SHAPES = [None, (1, 4), (1, 8), (1, 16), (1, 32), (2, 16), (2, 32)]  # (rows, warps) a program; None: the default


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("sweep_quant needs a CUDA device")
    x = torch.randn(*QUANT_SHAPE, device="cuda", dtype=torch.bfloat16) * 3
    for name, (fn, nbytes) in quantizer_cases(x).items():
        results = []
        for shape in SHAPES:
            options = kernels.KernelOptions(quantize=None if shape is None else kernels.QuantizeLaunch(*shape))
            try:
                with kernels.kernel_options(options):
                    ms = graph_ms(fn)
            except Exception as err:  # noqa: BLE001  (a shape that does not compile is a result too)
                print(f"# {name} {shape}: {type(err).__name__}", file=sys.stderr)
                continue
            results.append((ms, shape, nbytes / (ms * 1e-3) / COPY_CEILING * 100))
        print(f"{name}: " + "; ".join(f"{shape or 'default'} {ms:.4f} ms {p:.1f}%" for ms, shape, p in results),
              flush=True)


if __name__ == "__main__":
    main()
