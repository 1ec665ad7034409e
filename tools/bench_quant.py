"""CPU throughput of our NVFP4 / MXFP4 quantizers against torchao 0.18 on the same float32 input.

Pairs: our NVFP4 with a per-row global scale against torchao `nvfp4_quantize` given the same [rows, 1]
scale (the scale's computation is timed on our side only, which favours torchao), and our MXFP4 FLOOR /
RCEIL against torchao `to_mx`. Each pair is checked byte-identical first. Implementations are timed in
interleaved rounds after a warm-up and the median is reported (interleaving spreads background noise).
Usage: ``python tools/bench_quant.py [--rows 8192 --cols 8192 --rounds 5]``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
from _bench import interleaved_medians
from torch import Tensor

from trace_lightning.quant import quantize_mxfp4, quantize_nvfp4, row_global_scale

Quantizer = Callable[[Tensor], tuple[Tensor, Tensor]]


def pairs() -> dict[str, tuple[Quantizer, Quantizer]]:
    """name -> (ours, torchao), each returning (scale bytes, packed bytes)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    def ours_nvfp4(x: Tensor) -> tuple[Tensor, Tensor]:
        q = quantize_nvfp4(x, row_global_scale(x))
        return q.scale_bytes(), q.packed

    def torchao_nvfp4(x: Tensor) -> tuple[Tensor, Tensor]:
        scales, packed = nvfp4_quantize(x, per_tensor_scale=row_global_scale(x))
        return scales.view(torch.uint8), packed

    def ours_mx(mode: str) -> Quantizer:
        def run(x: Tensor) -> tuple[Tensor, Tensor]:
            q = quantize_mxfp4(x, mode)
            return q.scale_bytes(), q.packed

        return run

    def torchao_mx(mode: str) -> Quantizer:
        def run(x: Tensor) -> tuple[Tensor, Tensor]:
            scales, packed = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(mode))
            return scales.view(torch.uint8), packed.view(torch.uint8)

        return run

    return {
        "nvfp4 (row global)": (ours_nvfp4, torchao_nvfp4),
        "mxfp4 floor": (ours_mx("floor"), torchao_mx("floor")),
        "mxfp4 rceil": (ours_mx("rceil"), torchao_mx("rceil")),
    }


@torch.inference_mode()
def bench(x: Tensor, rounds: int) -> list[tuple[str, ...]]:
    rows = [("format", "ours s", "torchao s", "ours Melem/s", "torchao Melem/s", "ours / torchao speed")]
    for name, (ours, theirs) in pairs().items():
        for a, b in zip(ours(x), theirs(x), strict=True):
            if not torch.equal(a, b):
                raise AssertionError(f"{name}: our bytes differ from torchao's")
        t = interleaved_medians({"ours": lambda f=ours: f(x), "torchao": lambda f=theirs: f(x)}, rounds)
        n = x.numel() / 1e6
        speedup = t["torchao"] / t["ours"]
        rows.append((name, f"{t['ours']:.3f}", f"{t['torchao']:.3f}", f"{n / t['ours']:.0f}", f"{n / t['torchao']:.0f}",
                     f"{speedup:.2f}x"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 3
    print(f"CPU quantize {args.rows}x{args.cols} float32 ({x.numel() / 1e6:.0f}M elements), "
          f"{torch.get_num_threads()} threads, median of {args.rounds} after 1 warm-up")
    table = bench(x, args.rounds)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
