"""Reading compressed-tensors FP4 checkpoints (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``) back into
master weights.

``trace_lightning.export`` writes these folders for vLLM; ``load_hf`` reads them here so an exported policy can
be trained further or compared. Each FP4 Linear ``X`` is stored as ``X.weight_packed`` (uint8 [out, in/2], even
column in the low nibble), ``X.weight_scale`` (E4M3 or E8M0 bytes per block) and, for NVFP4,
``X.weight_global_scale``; the reader presents it as a dense ``X.weight`` dequantized by the format's own
definition, code * (scale / global_scale) in float32, the same operations in the same order as compressed-tensors'
decompression, so the two agree bit for bit. Layers the file keeps dense (listed in ``ignore``) pass through,
and the bf16 boundary layers of the model are the leading / trailing layers without any packed weight.

Our engine dequantizes code * (scale * g) with g = 1 / global_scale before rounding, and 1 / fl(1 / g) is not
always g, so an export also writes each NVFP4 module's g and the MXFP4 scale rule (``fp4_export.json``, which
other tools ignore). With it the reader returns the engine's own weights, except where quantizing them again
would not give the same bytes: the engine re-derives a matrix's NVFP4 global scale from its amax, so the elements
at a matrix's largest magnitude move by a few fp32 ulps to a value whose amax / (448 * 6) rounds to g; and an
MXFP4 RCEIL block whose largest code is 3 would come back as code 6 at half the scale, so its largest elements
move up by a few ulps (same code, same scale byte).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from trace_lightning.model.checkpoint_files import CheckpointError, SafetensorsReader
from trace_lightning.quant import E2M1_MAX, decode_e2m1, unpack_fp4
from trace_lightning.quant.mxfp4 import E8M0_BIAS, E8M0_NAN, mx_scale_bytes
from trace_lightning.quant.nvfp4 import E4M3_MAX

PACKED, SCALE, GLOBAL = "weight_packed", "weight_scale", "weight_global_scale"
EXPORT_NOTES_FILE = "fp4_export.json"
AMAX_SEARCH_ULPS = 64
AUXILIARY = (SCALE, GLOBAL, "input_global_scale")


@dataclass(frozen=True)
class PackedFormat:
    """One compressed-tensors FP4 storage format: its block size and how its scale bytes read."""

    name: str
    block_size: int
    global_scale: bool
    scale_dtype: torch.dtype


PACKED_FORMATS = {f.name: f for f in (
    PackedFormat("nvfp4-pack-quantized", 16, True, torch.float8_e4m3fn),
    PackedFormat("mxfp4-pack-quantized", 32, False, torch.uint8),
)}
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Reader(Protocol):
    """What ``checkpoint_files.SafetensorsReader`` offers: key -> tensor over a checkpoint's files."""

    def __contains__(self, key: str) -> bool: ...
    def keys(self) -> set[str]: ...
    def get(self, key: str) -> Tensor: ...


def _error(message: str) -> Exception:
    return CheckpointError(message)


def packed_format(raw_config: dict[str, Any], where: Path) -> PackedFormat | None:
    """The FP4 format of a config.json's compressed-tensors ``quantization_config``; None for a dense checkpoint."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise _error(f"{where}: quantization_config quant_method {qc.get('quant_method')!r} is not supported "
                     "(only compressed-tensors FP4 checkpoints)")
    names = ({qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}) - {None}
    if len(names) != 1 or next(iter(names)) not in PACKED_FORMATS:
        raise _error(f"{where}: compressed-tensors format {sorted(map(str, names))} is not supported; "
                     f"expected one of {sorted(PACKED_FORMATS)}")
    fmt = PACKED_FORMATS[next(iter(names))]
    for name, group in qc.get("config_groups", {}).items():
        w = group.get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True))
        if got != (4, "float", fmt.block_size, True):
            raise _error(f"{where}: config group {name!r} weights (num_bits, type, group_size, symmetric) = {got}, "
                         f"expected (4, 'float', {fmt.block_size}, True) for {fmt.name}")
    return fmt


def boundary_layers(path: Path, raw_config: dict[str, Any], n_layers: int) -> dict[str, int]:
    """``bf16_first_layers`` / ``bf16_last_layers`` of a compressed checkpoint: its leading and trailing layers
    without packed weights (an exported policy's boundary layers); empty for a dense checkpoint."""
    if packed_format(raw_config, path) is None:
        return {}
    quantized = sorted({int(m.group(1)) for k in SafetensorsReader(path).keys()
                        if k.endswith("." + PACKED) and (m := LAYER.match(k))})
    if not quantized:
        return {"bf16_first_layers": n_layers, "bf16_last_layers": 0}
    if quantized != list(range(quantized[0], quantized[-1] + 1)):
        dense = sorted(set(range(quantized[0], quantized[-1])) - set(quantized))
        raise _error(f"{path}: dense layers {dense} between FP4 layers; the model keeps only its first and last "
                     "layers unquantized")
    return {"bf16_first_layers": quantized[0], "bf16_last_layers": n_layers - 1 - quantized[-1]}


class DequantizingReader:
    """A reader over a compressed checkpoint that shows each packed Linear as its dense float32 ``.weight``."""

    def __init__(self, inner: Reader, fmt: PackedFormat, notes: ExportNotes | None = None) -> None:
        self.inner, self.fmt, self.notes = inner, fmt, notes or ExportNotes()
        self.packed = {k.removesuffix(PACKED) + "weight" for k in inner.keys() if k.endswith("." + PACKED)}
        hidden = {k.removesuffix("weight") + aux for k in self.packed for aux in (PACKED, *AUXILIARY)}
        self._keys = (inner.keys() - hidden) | self.packed

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def get(self, key: str) -> Tensor:
        if key not in self.packed:
            return self.inner.get(key)
        base = key.removesuffix("weight")
        scales = self.inner.get(base + SCALE)
        g = self.inner.get(base + GLOBAL) if self.fmt.global_scale else None
        packed, ours = self.inner.get(base + PACKED), self.notes.global_scales.get(base[:-1])
        if ours is not None:
            g_ours = torch.tensor([ours], dtype=torch.float32)
            if g is None or not torch.equal(torch.div(torch.ones(1), g_ours), g.reshape(1)):
                raise _error(f"{key}: {EXPORT_NOTES_FILE} does not match {GLOBAL} (a stale or foreign file)")
            return engine_weight(packed, scales, g_ours, key)
        w = dequantize_packed(packed, scales, g, self.fmt, key)
        return stable_rceil(w, scales, key) if self.notes.mx_mode == "rceil" and not self.fmt.global_scale else w


def _check_parts(packed: Tensor, scales: Tensor, g: Tensor | None, fmt: PackedFormat, key: str) -> None:
    rows, half = packed.shape if packed.dim() == 2 else (None, None)
    if packed.dtype != torch.uint8 or rows is None:
        raise _error(f"{key}: {PACKED} must be uint8 [out, in/2], got {packed.dtype} {tuple(packed.shape)}")
    if scales.dtype != fmt.scale_dtype or tuple(scales.shape) != (rows, 2 * half // fmt.block_size):
        raise _error(f"{key}: {SCALE} must be {fmt.scale_dtype} {(rows, 2 * half // fmt.block_size)} for "
                     f"{fmt.name}, got {scales.dtype} {tuple(scales.shape)}")
    if fmt.global_scale and (g is None or g.dtype != torch.float32 or g.numel() != 1):
        raise _error(f"{key}: {GLOBAL} must be one float32, got "
                     f"{None if g is None else (g.dtype, tuple(g.shape))}")


def dequantize_packed(packed: Tensor, scales: Tensor, g: Tensor | None, fmt: PackedFormat, key: str) -> Tensor:
    """float32 [out, in]: code * (scale / global_scale) per block (compressed-tensors' definition and order)."""
    _check_parts(packed, scales, g, fmt, key)
    if fmt.global_scale:
        multiplier = scales.float() / g.reshape(1)
    else:
        biased = scales.to(torch.int32)
        if bool((biased == E8M0_NAN).any()):
            raise _error(f"{key}: NaN block scale (E8M0 byte {E8M0_NAN})")
        multiplier = torch.exp2((biased - E8M0_BIAS).float())
    if not bool(torch.isfinite(multiplier).all()):
        raise _error(f"{key}: non-finite block scale")
    values = decode_e2m1(unpack_fp4(packed)).unflatten(-1, (-1, fmt.block_size))
    return (values * multiplier.unsqueeze(-1)).flatten(-2)


def engine_weight(packed: Tensor, scales: Tensor, g: Tensor, key: str) -> Tensor:
    """float32 [out, in]: the engine's NVFP4 weight code * (scale * g), with the matrix's largest magnitude moved
    to the nearest value whose amax / (448 * 6) rounds to g (so quantizing it again gives the same bytes)."""
    fmt = PACKED_FORMATS["nvfp4-pack-quantized"]
    _check_parts(packed, scales, g, fmt, key)
    values = decode_e2m1(unpack_fp4(packed)).unflatten(-1, (-1, fmt.block_size))
    w = (values * (scales.float() * g).unsqueeze(-1)).flatten(-2)
    top = (torch.tensor([E4M3_MAX]) * g) * E2M1_MAX  # the largest value any element of the matrix can take
    at_top = w.abs() == top
    if bool(at_top.any()):
        w = torch.where(at_top, torch.copysign(amax_for(g, top, key), w), w)
    return w


def amax_for(g: Tensor, near: Tensor, key: str) -> Tensor:
    """The float32 nearest ``near`` whose division by 448 * 6 rounds to ``g`` (the weight quantizer's rule)."""
    bits = near.view(torch.int32) + torch.tensor([0, *(s * k for k in range(1, AMAX_SEARCH_ULPS) for s in (-1, 1))],
                                                  dtype=torch.int32)
    candidates = bits.view(torch.float32)
    hits = candidates[candidates / (E4M3_MAX * E2M1_MAX) == g]
    if not hits.numel():
        raise _error(f"{key}: no float32 amax within {AMAX_SEARCH_ULPS} ulps gives the global scale {g.item()!r}")
    return hits[:1]


def stable_rceil(w: Tensor, scale_bytes: Tensor, key: str) -> Tensor:
    """MXFP4 RCEIL weights [out, in] whose blocks quantize again to ``scale_bytes``: a block whose largest code is
    3 has amax / 6 exactly a power of two, one step below its scale, so its largest elements move up by the
    fewest ulps that make the quantizer's scale rule (``mx_scale_bytes``) pick its scale byte again."""
    blocks = w.unflatten(-1, (-1, PACKED_FORMATS["mxfp4-pack-quantized"].block_size))
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # (out, nb, 1)
    todo = mx_scale_bytes(blocks, "rceil") != scale_bytes
    moved = amax.clone()
    for ulp in range(1, AMAX_SEARCH_ULPS + 1):
        if not bool(todo.any()):
            break
        candidate = (amax.view(torch.int32) + ulp).view(torch.float32)
        fits = todo & (mx_scale_bytes(candidate, "rceil") == scale_bytes)
        moved = torch.where(fits.unsqueeze(-1), candidate, moved)
        todo &= ~fits
    if bool(todo.any()):
        raise _error(f"{key}: {int(todo.sum())} RCEIL blocks do not requantize to their scale byte")
    at_max = (blocks.abs() == amax) & (moved != amax)
    return torch.where(at_max, torch.copysign(moved.expand_as(blocks), blocks), blocks).flatten(-2)


@dataclass(frozen=True)
class ExportNotes:
    """What an export knows beyond the format (``fp4_export.json``): our NVFP4 global scales, the MX scale rule."""

    global_scales: dict[str, float] = field(default_factory=dict)
    mx_mode: str | None = None

    @classmethod
    def read(cls, path: Path) -> ExportNotes:
        file = path / EXPORT_NOTES_FILE
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text())
            scales = {module: float.fromhex(g) for module, g in raw.get("global_scales", {}).items()}
            return cls(scales, raw.get("mx_mode"))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise _error(f"cannot read {file}: {e}") from e


def dequantizing_reader(reader: Reader, path: Path) -> Reader:
    """``reader`` itself for a dense checkpoint, a DequantizingReader for a compressed-tensors FP4 one."""
    file = path / "config.json"
    fmt = packed_format(json.loads(file.read_text()), file) if file.is_file() else None
    return reader if fmt is None else DequantizingReader(reader, fmt, ExportNotes.read(path))
