"""Exact identity of weight tensors: a digest of their bytes, taken where they live.

Records carry the identity of the weights that generated them, and the trainer refuses a record whose
identity is not that of the weights it last synced. Sums of the values cannot serve: permutations (two
experts, two embedding rows) keep them, so the digest is a function of every byte and its position.

It is taken in two stages so that a CUDA model never crosses to the host whole:

1. On the tensor's device, its bytes are read as 16-bit words (bytes, when the count is odd) and cut into
   rows of ``ROW_WORDS`` words; each row becomes ``LANES`` exact integer sums ``sum_j word_j * a[j, lane]``
   in int64 (|word| < 2^15, a < 2^31, 2^15 words: every partial sum stays below 2^61, so no wrap-around and
   the same integers on every device and thread count). The multipliers are nonzero and, within a lane,
   distinct: changing one word, or swapping two different words of a row, always changes the row's sums. On a
   GPU the int64 products are made and summed; on a CPU one float64 GEMM against the multipliers' 16-bit halves
   gives the same integers about 3x faster (every partial sum stays below 2^46, exact in float64).
2. On the host, sha256 over the dtype, the shape and the rows' sums in order (1/4096 of the bytes).

Two tensors of one dtype and shape that differ collide only if, in every lane, some row's weighted sum of
the differences is exactly 0: a single changed word or swapped pair never does, any other change does so with
probability about 2^-31 per lane over the multipliers, so 2^-62. The multipliers are public constants, so
this guards against accidents (a wrong checkpoint, permuted experts), not against someone forging weights.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

ROW_WORDS = 1 << 15
"""Words per row: 2^15 words below 2^15 in magnitude times multipliers below 2^31 sum below 2^61."""
LANES = 2
"""Independent multiplier columns: a collision must happen in each."""
CHUNK_ROWS = 1 << 7
"""Rows multiplied at once: a chunk's int64 products (GPU) are 2^7 * 2^15 * LANES * 8 bytes = 64 MiB."""

_MASK31 = np.uint64((1 << 31) - 1)


def _mix31(x: np.ndarray) -> np.ndarray:
    """A bijection of [0, 2^31) (odd multiplications and xor-shifts within 31 bits) that maps only 0 to 0."""
    for mult, shift in ((0x7FEB352D, 16), (0x846CA68B, 15), (0x5BD1E995, 16)):
        x = (x * np.uint64(mult)) & _MASK31  # x < 2^31, mult < 2^32: no uint64 wrap
        x ^= x >> np.uint64(shift)
    return x


@functools.cache
def multipliers() -> Tensor:
    """int64 [ROW_WORDS, LANES] in [1, 2^31): distinct within each lane (a bijection of distinct nonzero inputs)."""
    inputs = np.arange(1, ROW_WORDS * LANES + 1, dtype=np.uint64).reshape(LANES, ROW_WORDS).T
    return torch.from_numpy(_mix31(inputs).astype(np.int64))


@functools.cache
def _multipliers_on(device: torch.device) -> Tensor:
    return multipliers().to(device)


@functools.cache
def _multiplier_halves() -> Tensor:
    """float64 [ROW_WORDS, 2 * LANES]: each lane's multipliers' low and high 16 bits (the CPU path's GEMM)."""
    a = multipliers()
    return torch.cat([a & 0xFFFF, a >> 16], dim=1).to(torch.float64)


def tensor_words(t: Tensor) -> Tensor:
    """The tensor's bytes in memory order as a 1-D view: int16 words, or uint8 when the byte count is odd."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() % 2 == 0:
        return flat.view(torch.int16)  # never larger than the element: always a valid view
    return flat.view(torch.uint8)


def _products_summed(rows: Tensor) -> Tensor:
    """[n, ROW_WORDS] words -> int64 [n, LANES]: the products made in int64 and summed (any device)."""
    return (rows.unsqueeze(-1) * _multipliers_on(rows.device)[:rows.shape[1]]).sum(dim=1)


def _gemm_summed(rows: Tensor) -> Tensor:
    """The same integers through one float64 GEMM with 16-bit multiplier halves (about 3x faster on a CPU): every
    partial sum is an integer below 2^15 * 2^16 * 2^15 = 2^46 < 2^53, so exact in any summation order."""
    halves = (rows.to(torch.float64) @ _multiplier_halves()[:rows.shape[1]]).to(torch.int64)
    return halves[:, :LANES] + halves[:, LANES:] * (1 << 16)


def row_sums(t: Tensor) -> Tensor:
    """int64 [rows * LANES] on t's device: stage 1 (module docstring) over the tensor's words."""
    words = tensor_words(t)
    summed = _gemm_summed if words.device.type == "cpu" else _products_summed
    full = words.numel() // ROW_WORDS
    parts = [summed(words[start * ROW_WORDS:min(start + CHUNK_ROWS, full) * ROW_WORDS].view(-1, ROW_WORDS))
             for start in range(0, full, CHUNK_ROWS)]
    tail = words[full * ROW_WORDS:]
    if tail.numel():
        parts.append(summed(tail.view(1, -1)))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    return torch.cat(parts).reshape(-1)


def _finite_flag(t: Tensor) -> Tensor:
    """int64 scalar on t's device: 1 unless t is floating point and holds NaN or inf (min and max propagate
    both; read once, nothing written)."""
    if not t.is_floating_point() or t.numel() == 0:
        return torch.ones((), dtype=torch.int64, device=t.device)
    low, high = torch.aminmax(t.detach())
    return (torch.isfinite(low) & torch.isfinite(high)).to(torch.int64)


def scan_tensors(named: Mapping[str, Tensor]) -> tuple[dict[str, str], dict[str, bool]]:
    """({name: byte digest}, {name: all values finite}) with one host transfer for all tensors."""
    if not named:
        return {}, {}
    sums = [row_sums(t) for t in named.values()]
    flags = [_finite_flag(t) for t in named.values()]
    device = sums[0].device
    host = torch.cat([s.to(device) for s in sums] + [torch.stack([f.to(device) for f in flags])]).cpu().numpy()
    digests, offset = {}, 0
    for (name, t), s in zip(named.items(), sums, strict=True):
        h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}:".encode())
        h.update(host[offset:offset + s.numel()].astype("<i8").tobytes())
        digests[name], offset = h.hexdigest(), offset + s.numel()
    finite = {name: bool(v) for name, v in zip(named, host[offset:], strict=True)}
    return digests, finite


def tensor_digests(named: Mapping[str, Tensor]) -> dict[str, str]:
    """{name: sha256 hex of the tensor's dtype, shape and bytes (two stages, module docstring)}."""
    return scan_tensors(named)[0]


def tensor_digest(t: Tensor) -> str:
    """One tensor's byte digest (tensor_digests)."""
    return tensor_digests({"": t})[""]


def weights_fingerprint(digests: Mapping[str, str]) -> str:
    """The model identity a record carries: sha256 over every weight's name and byte digest, by name."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


__all__ = ["LANES", "ROW_WORDS", "multipliers", "row_sums", "scan_tensors", "tensor_digest", "tensor_digests",
           "tensor_words", "weights_fingerprint"]
