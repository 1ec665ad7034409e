"""One byte row per token: how a batch of records is packed into a single tensor (DESIGN.md section 4).

Each recorded (layer, site) owns a fixed slot of a token's row: its row global scales (float32, NVFP4 with row
globals only), its block scale bytes, then its payload (packed 4-bit codes, or parity bits packed 8 per byte).
A batch's record is then one uint8 tensor [B, T, width]: the rollout's recorder writes each site straight
into its slot while decoding (no per-sequence objects; on the device, or streamed to the host for long
rollouts), training receives it in one copy, and every site is read back as a view. Slots start on 4-byte
boundaries and the width is a multiple of 16, so the float32 globals are aligned views and a row never straddles
a vector load needlessly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from trace_lightning.model.config import MoEConfig
from trace_lightning.quant import MXFP4, NVFP4, BlockFP4, FP4Format
from trace_lightning.sim.quantize import pack_parity

SiteKey = tuple[int, str]
GLOBAL_SCALE_BYTES = 4
ELEMENTS_PER_BYTE = {"full": 2, "parity": 8}
ONE_SCALE_BYTE = {"nvfp4": 0x38, "mxfp4": 127}
"""Block-scale bytes that decode to exactly 1.0: padded rows dequantize to finite zeros, never NaN."""
_ALIGN, _ROW_ALIGN = 4, 16
_MULTI_ROW_SITES = frozenset({"k", "v", "moe_down"})


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def site_rows(config: MoEConfig) -> dict[str, tuple[int, int]]:
    """(rows per token, elements per row) of every activation site of one layer."""
    c = config
    rows = {"attn_in": (1, c.dim), "k": (c.n_kv_heads, c.head_dim), "v": (c.n_kv_heads, c.head_dim),
            "attn_out": (1, c.q_dim), "moe_in": (1, c.dim), "moe_down": (c.top_k, c.moe_intermediate)}
    if c.n_shared_experts:
        rows["shared_down"] = (1, c.shared_intermediate)
    return rows


@dataclass(frozen=True)
class SiteSlot:
    """Where one (layer, site) lives in a token's row, and the shape of its rows."""

    key: SiteKey
    rows: tuple[int, ...]
    """Row dims per token: () for one row (attn_in, ...), (Hkv,) for k / v, (top_k,) for moe_down."""
    k: int
    """Elements per row."""
    offset: int
    global_bytes: int
    scale_bytes: int
    payload_bytes: int

    @property
    def n_rows(self) -> int:
        return math.prod(self.rows)

    @property
    def size(self) -> int:
        return self.global_bytes + self.scale_bytes + self.payload_bytes

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class RecordLayout:
    """The byte layout of one token's record: a slot per recorded (layer, site), in key order."""

    fmt: FP4Format
    mode: str
    slots: tuple[SiteSlot, ...]
    width: int
    """Bytes per token row (a multiple of 16; slack bytes after the last slot stay zero)."""

    @classmethod
    def build(cls, fmt: FP4Format, mode: str, shapes: Mapping[SiteKey, tuple[tuple[int, ...], int]]) -> RecordLayout:
        """A layout for sites {(layer, site): (row dims, elements per row)}."""
        if mode not in ELEMENTS_PER_BYTE:
            raise ValueError(f"record mode must be 'full' or 'parity', got {mode!r}")
        has_global = fmt.kind == "nvfp4" and fmt.global_scale != "none"
        slots, offset = [], 0
        for key in sorted(shapes):
            rows, k = shapes[key]
            if k % fmt.block_size or k % 8:
                raise ValueError(f"layer {key[0]} site {key[1]}: {k} elements per row is not a multiple of the "
                                 f"{fmt.block_size}-element block and of 8")
            n = math.prod(rows)
            slot = SiteSlot(key, tuple(rows), k, offset, n * GLOBAL_SCALE_BYTES if has_global else 0,
                            n * k // fmt.block_size, n * k // ELEMENTS_PER_BYTE[mode])
            slots.append(slot)
            offset = _round_up(slot.end, _ALIGN)
        return cls(fmt, mode, tuple(slots), _round_up(max(offset, 1), _ROW_ALIGN))

    @classmethod
    def for_model(cls, config: MoEConfig, fmt: FP4Format, mode: str, keys: Iterable[SiteKey]) -> RecordLayout:
        """A layout for `keys` of a model config, site shapes taken from the config."""
        per_site = site_rows(config)
        shapes = {}
        for layer, site in keys:
            if site not in per_site:
                raise ValueError(f"site {site!r} does not exist in this model (sites: {sorted(per_site)})")
            rows, k = per_site[site]
            shapes[(layer, site)] = (() if site not in _MULTI_ROW_SITES else (rows,), k)
        return cls.build(fmt, mode, shapes)

    @property
    def keys(self) -> list[SiteKey]:
        return [s.key for s in self.slots]

    @functools.cached_property
    def _by_key(self) -> dict[SiteKey, SiteSlot]:
        return {s.key: s for s in self.slots}

    def slot(self, key: SiteKey) -> SiteSlot:
        if key not in self._by_key:
            raise KeyError(f"no record for layer {key[0]} site {key[1]}; recorded: {self.keys}")
        return self._by_key[key]

    @property
    def payload_bytes_per_token(self) -> int:
        """Bytes of record a token carries (the slots' sizes, without alignment slack)."""
        return sum(s.size for s in self.slots)

    def select(self, keys: Iterable[SiteKey] | None = None, mode: str | None = None) -> RecordLayout:
        """The layout of a compaction of this one: only `keys` (None: all), in `mode` (None: the same)."""
        mode = mode or self.mode
        if self.mode == "parity" and mode == "full":
            raise ValueError("a parity record cannot be expanded back to full codes")
        chosen = self.keys if keys is None else sorted(set(keys))
        missing = [key for key in chosen if key not in self.keys]
        if missing:
            raise ValueError(f"sites {missing} were requested but not recorded")
        return RecordLayout.build(self.fmt, mode, {k: (self.slot(k).rows, self.slot(k).k) for k in chosen})

    # ---- bytes <-> blocks --------------------------------------------------------------------------
    def view(self, data: Tensor, key: SiteKey) -> tuple[Tensor, Tensor, Tensor | None]:
        """One site's (scale bytes, payload, row globals or None) as views of data uint8 [*lead, width]."""
        s, lead = self.slot(key), data.shape[:-1]
        at = s.offset + s.global_bytes
        g = data[..., s.offset : at].view(torch.float32).reshape(*lead, *s.rows, 1) if s.global_bytes else None
        scales = data[..., at : at + s.scale_bytes].reshape(*lead, *s.rows, -1)
        payload = data[..., at + s.scale_bytes : s.end].reshape(*lead, *s.rows, -1)
        return scales, payload, g

    def views(self, data: Tensor) -> dict[SiteKey, tuple[Tensor, Tensor, Tensor | None]]:
        """Every site's views (see ``view``)."""
        return {key: self.view(data, key) for key in self.keys}

    def blocks(self, data: Tensor, key: SiteKey) -> BlockFP4:
        """The full-mode tensor of one site (copies, leading dims of data), as the rollout quantized it."""
        if self.mode != "full":
            raise ValueError("parity records keep no codes; record in full mode to read the FP4 tensors back")
        scales, payload, g = self.view(data, key)
        if self.fmt.kind == "mxfp4":
            return MXFP4(packed=payload.clone(), scales=scales.clone().view(torch.float8_e8m0fnu),
                         mode=self.fmt.mx_mode)
        return NVFP4(packed=payload.clone(), scales=scales.clone().view(torch.float8_e4m3fn),
                     global_scale=None if g is None else g.clone())

    def pad_row(self, device: torch.device | str) -> Tensor:
        """The row of a position without a record: unit block scales, unit globals, +0 codes."""
        row = torch.zeros(self.width, dtype=torch.uint8)
        one = torch.tensor([1.0], dtype=torch.float32).view(torch.uint8)
        for s in self.slots:
            if s.global_bytes:
                row[s.offset : s.offset + s.global_bytes] = one.repeat(s.n_rows)
            at = s.offset + s.global_bytes
            row[at : at + s.scale_bytes] = ONE_SCALE_BYTE[self.fmt.kind]
        return row.to(device)

    def repack(self, data: Tensor, source: RecordLayout) -> Tensor:
        """data uint8 [*lead, source.width] laid out by `source` -> [*lead, self.width] in this layout (a subset of
        its sites, parity bits taken from full codes when this layout is parity and the source full)."""
        out = torch.zeros(*data.shape[:-1], self.width, dtype=torch.uint8, device=data.device)
        for s in self.slots:
            src = source.slot(s.key)
            if (src.rows, src.k) != (s.rows, s.k):
                raise ValueError(f"layer {s.key[0]} site {s.key[1]}: rows {src.rows} of {src.k} in the source, "
                                 f"{s.rows} of {s.k} here")
            head = s.global_bytes + s.scale_bytes
            out[..., s.offset : s.offset + head] = data[..., src.offset : src.offset + head]
            payload = data[..., src.offset + head : src.end]
            if source.mode != self.mode:
                payload = pack_parity(payload.reshape(*payload.shape[:-1], s.n_rows, -1)).flatten(-2)
            out[..., s.offset + head : s.end] = payload
        return out
