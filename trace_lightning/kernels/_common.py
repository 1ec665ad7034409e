"""Host-side helpers shared by the Triton op wrappers."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class AttentionLaunch:
    """One launch shape of the decode attention's split kernel."""

    keys: int
    """Keys per loop iteration (BLOCK_S)."""
    warps: int
    stages: int
    """Software pipeline stages of the key loop."""


@dataclass(frozen=True)
class GemmLaunch:
    """One launch shape of a W4A16 GEMM of the fused MoE; None keeps the kernel's own choice by size."""

    block_n: int | None = None
    block_k: int | None = None
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class QuantizeLaunch:
    """One launch shape of the NVFP4 quantizers: rows and warps a program (K tiles stay whole rows up to 8192)."""

    rows: int
    warps: int


@dataclass(frozen=True)
class KernelOptions:
    """What a user or a benchmark may choose about how the Triton kernels launch, in the manner of triton_kernels'
    OptFlags: shapes and scheduling, never the arithmetic (another K tile may only regroup float32 sums). The engine
    passes its `kernel_options` down with `kernel_options(...)`; every default is the measured best on an H200
    (docs/benchmarks.md)."""

    autotune: bool = False
    """Autotune the GEMM and attention block shapes on CUDA (benchmarks, long rollouts). Off, the kernels take fixed
    shapes by size: autotuning runs every config once per new shape, and tests and the interpreter never need it."""
    pdl: bool = True
    """Programmatic dependent launch on sm_90 and newer (see grid_dependency); False for plain stream order, e.g.
    to rule it out while debugging."""
    attention: AttentionLaunch = field(default_factory=lambda: AttentionLaunch(64, 2, 3))
    """Decode attention shape for programs that stream fewer than kv.ATTN_LONG_KEYS keys. tools/sweep_attention.py on
    an H200: 64 keys / 2 warps / 3 stages is the best of 48 shapes at B=64 / 2K context (62 us)."""
    attention_long: AttentionLaunch | None = field(default_factory=lambda: AttentionLaunch(32, 1, 3))
    """Shape for programs that stream kv.ATTN_LONG_KEYS keys or more (None: `attention` at every length): one warp
    needs no cross-warp step in the softmax reductions (B=256 / 2K: 220 -> 199 us, B=250 / 16K: 1629 -> 1425 us)."""
    attention_programs_per_sm: int = 4
    """Attention programs one SM runs at a time, by which the key range is split (kv.attention_splits)."""
    moe_gate_up: GemmLaunch = field(default_factory=GemmLaunch)
    """Launch shape of the fused MoE's gate/up GEMM (tools/sweep_moe.py varies it)."""
    moe_down: GemmLaunch = field(default_factory=GemmLaunch)
    """Launch shape of the fused MoE's down GEMM."""
    quantize: QuantizeLaunch | None = None
    """Launch shape of the NVFP4 quantizers (tools/sweep_quant.py varies it); None: quantize._launch_shape's by size."""


DEFAULT_OPTIONS = KernelOptions()
_OPTIONS: ContextVar[KernelOptions | None] = ContextVar("trace_lightning_kernel_options", default=None)


@contextmanager
def kernel_options(options: KernelOptions) -> Iterator[KernelOptions]:
    """Launch the kernels called inside this block with `options` (a scope, like torch.autocast, so that two engines
    in one process keep their own; a CUDA graph captured inside keeps the launches it captured)."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"kernel_options needs a KernelOptions, got {type(options).__name__}")
    token = _OPTIONS.set(options)
    try:
        yield options
    finally:
        _OPTIONS.reset(token)


def active_options() -> KernelOptions:
    """The KernelOptions of the innermost kernel_options block (the defaults outside any)."""
    return _OPTIONS.get() or DEFAULT_OPTIONS


def autotune_on(device: torch.device) -> bool:
    """Whether to autotune block shapes: on CUDA when the active KernelOptions ask for it."""
    return device.type == "cuda" and active_options().autotune


@functools.lru_cache(maxsize=8)
def _has_grid_dependency_control(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def grid_dependency(device: torch.device) -> dict[str, bool]:
    """Launch options for programmatic dependent launch on Hopper and newer (KernelOptions.pdl): a kernel's successor
    may launch as its programs exit.

    A decode step is ~20 small kernels a layer, each of which would start only after the previous one had drained
    and flushed. Launched with `launch_pdl`, a kernel's programs may be scheduled before the previous kernel has
    finished; they wait in `griddepcontrol.wait` (`_fp4.await_previous_grid`, the first thing every kernel here does
    when PDL is set) until its writes are visible, so results are those of plain stream order. Measured on an H200
    (H200 2026-12-04, decode step of the qwen3-30b-a3b shape): within 1% of no PDL at every batch; letting the
    successor launch as soon as all programs run instead was 6% faster at batch 1 but 4 / 13% slower at batch 64 /
    256 (early programs pile onto the SMs that free up first), and was removed. Empty (plain launches) on CPU, under
    the interpreter and before sm_90."""
    if device.type != "cuda" or not active_options().pdl:
        return {}
    return {"PDL": True, "launch_pdl": True} if _has_grid_dependency_control(device.index or 0) else {}


def fast_dequant(dtype: torch.dtype, device: torch.device) -> bool:
    """Dequantize with packed bf16x2 inline PTX (bf16 operands on CUDA); otherwise the portable bit-arithmetic path,
    which also runs under the CPU interpreter (and for fp16 / fp32 operands)."""
    return device.type == "cuda" and dtype == torch.bfloat16
