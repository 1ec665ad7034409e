"""Host-side helpers shared by the Triton op wrappers."""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl
from torch import Tensor

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def mma_torch_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """torch dtype of the MMA operands for activations of this dtype (float32 stays exact: IEEE dot).

    Under the CPU interpreter bf16/fp16 dots are wrong (it multiplies raw bits), so there the operands go
    in as float32: they are exact in bf16 anyway (weights are code * scale), so the products are the same.
    """
    if dtype not in TL_DTYPES:
        raise ValueError(f"activations must be bfloat16, float16 or float32, got {dtype}")
    return dtype if device.type == "cuda" else torch.float32


def mma_dtype(dtype: torch.dtype, device: torch.device):  # noqa: ANN201 (a triton dtype)
    """mma_torch_dtype as the Triton dtype the kernels take."""
    return TL_DTYPES[mma_torch_dtype(dtype, device)]


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    return "ieee" if dtype == torch.float32 or device.type != "cuda" else "tf32"


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a token 4 under the CPU interpreter)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


def scale_bytes(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried by the W4A16 GEMM autotuners
GEMM_TILES = ((64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4), (128, 256, 8, 3), (64, 256, 8, 4),
              (32, 128, 4, 2))
TUNED_K_UNIT = 256  # every autotuned BLOCK_K divides it


def tuned(kernel, configs: list, key: list[str]):  # noqa: ANN001, ANN201 (triton kernels)
    """(plain, autotuned) launchers of one kernel."""
    import triton

    return kernel, triton.autotune(configs=configs, key=key)(kernel)


def autotune_on(device: torch.device) -> bool:
    """Autotune block shapes on CUDA when TRACE_LIGHTNING_AUTOTUNE=1 (benchmarks, long rollouts); tests and the
    interpreter use the fixed heuristic shapes (autotuning runs every config once per new shape)."""
    return device.type == "cuda" and os.environ.get("TRACE_LIGHTNING_AUTOTUNE", "0") == "1"


def swap_ab() -> bool:
    """Compute out^T = dequant(w) @ x^T in the W4A16 GEMMs (default; TRACE_LIGHTNING_SWAP_AB=0 for x @ w^T).

    Swapped, the dequantized weight tile is the MMA's A operand, which Hopper's wgmma reads from registers,
    and the weight rows fill its 64-row M side even at decode batch sizes; unswapped it is the B operand,
    which must go through shared memory, and M = 16 token rows is below wgmma's minimum tile."""
    return os.environ.get("TRACE_LIGHTNING_SWAP_AB", "1") != "0"


@functools.lru_cache(maxsize=8)
def _has_grid_dependency_control(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def grid_dependency(device: torch.device) -> dict[str, int | bool]:
    """Launch options for programmatic dependent launch on Hopper and newer (TRACE_LIGHTNING_PDL): 2 (the default) lets
    a kernel's successor launch as its programs exit, 1 as soon as all its programs run, 0 turns it off.

    A decode step is ~20 small kernels a layer, each of which would start only after the previous one had drained
    and flushed. Launched with `launch_pdl`, a kernel's programs may be scheduled before the previous kernel has
    finished; they wait in `griddepcontrol.wait` (`_fp4.await_previous_grid`, the first thing every kernel here does
    when PDL is set) until its writes are visible, so results are those of plain stream order. Measured on an H200
    (docs/benchmarks.md v13, decode step of the qwen3-30b-a3b shape): mode 1 is 6% faster at batch 1 but 4 / 13%
    slower at batch 64 / 256 (early programs pile onto the SMs that free up first), mode 2 within 1% of no PDL at
    every batch. Empty (plain launches) on CPU, under the interpreter and before sm_90."""
    mode = int(os.environ.get("TRACE_LIGHTNING_PDL", "2"))
    if device.type != "cuda" or mode == 0:
        return {}
    return {"PDL": mode, "launch_pdl": True} if _has_grid_dependency_control(device.index or 0) else {}


def fast_dequant(dtype: torch.dtype, device: torch.device) -> bool:
    """Dequantize with packed bf16x2 inline PTX (bf16 operands on CUDA; TRACE_LIGHTNING_FAST_DEQUANT=0 turns it
    off); otherwise the portable bit-arithmetic path, which also runs under the CPU interpreter."""
    return device.type == "cuda" and dtype == torch.bfloat16 and os.environ.get("TRACE_LIGHTNING_FAST_DEQUANT",
                                                                                   "1") != "0"
