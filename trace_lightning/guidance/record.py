"""QuantRecord: how one rollout sequence rounded every recorded activation to FP4 (DESIGN.md section 4).

The training side must never recompute a recorded site's scales, so a record keeps them exactly (the
row global scale in fp32 and the block scales as their bytes) and, per element, either the full E2M1
code (mode ``full``, 4 bits) or only its mantissa bit (mode ``parity``, 1 bit, packed 8 per byte),
which guided rounding needs to land on the rollout's code. Rows are aligned with the token positions
of prompt + response, so a record is a set of tensors with a leading time dim T; a ``BatchRecord``
stacks records into (B, T, ...) for a training minibatch and marks which positions are real.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from trace_lightning.guidance.identity import tensor_digests, weights_fingerprint
from trace_lightning.guidance.layout import ELEMENTS_PER_BYTE, RecordLayout
from trace_lightning.quant import MXFP4, NVFP4, BlockFP4, FP4Format, pack_fp4, unpack_fp4
from trace_lightning.quant.guided import check_guidance_mode
from trace_lightning.sim.record import write_record_slot

SiteKey = tuple[int, str]

_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)


def pack_bits(bits: Tensor) -> Tensor:
    """Pack 0/1 values [..., K] (K % 8 == 0) into uint8 [..., K/8], element i at bit i % 8 of byte i // 8."""
    if bits.shape[-1] % 8:
        raise ValueError(f"last dim must be a multiple of 8 to pack bits, got shape {tuple(bits.shape)}")
    groups = bits.to(torch.int32).reshape(*bits.shape[:-1], -1, 8)
    return (groups * _BIT_WEIGHTS.to(bits.device)).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: Tensor) -> Tensor:
    """Inverse of pack_bits: uint8 [..., K/8] -> uint8 0/1 values [..., K]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def format_of(q: BlockFP4) -> FP4Format:
    """The activation format a captured tensor was quantized in (row global scale or none for NVFP4)."""
    if isinstance(q, MXFP4):
        return FP4Format("mxfp4", mx_mode=q.mode)
    if isinstance(q, NVFP4):
        return FP4Format("nvfp4", global_scale="none" if q.global_scale is None else "row")
    raise ValueError(f"captures must be NVFP4 or MXFP4 tensors, got {type(q).__name__}")


def format_name(fmt: FP4Format) -> str:
    """Short name parse_format reads back: "nvfp4", "nvfp4:none", "mxfp4:floor", "mxfp4:rceil"."""
    if fmt.kind == "mxfp4":
        return f"mxfp4:{fmt.mx_mode}"
    return "nvfp4" if fmt.global_scale == "row" else f"nvfp4:{fmt.global_scale}"


@dataclass
class SiteRecord:
    """One site's record: tensors with leading dims `lead` (T for a sequence, (B, T) for a batch) then rows.

    Every tensor is kept in its compact storage dtype; `ref` rebuilds the BlockFP4 guided rounding reads.
    """

    scale_bytes: Tensor
    """uint8 [*lead, *rows, K/block]: the block scales' bit patterns."""
    payload: Tensor
    """uint8: packed codes [*lead, *rows, K/2] (full) or packed parity bits [*lead, *rows, K/8] (parity)."""
    global_scale: Tensor | None = None
    """float32 [*lead, *rows, 1]: NVFP4 row global scales; None for MXFP4 and NVFP4 without a global scale."""

    @classmethod
    def from_blocks(cls, q: BlockFP4, mode: str) -> SiteRecord:
        codes = q.packed if mode == "full" else pack_bits(q.codes() & 1)
        g = q.global_scale if isinstance(q, NVFP4) else None
        return cls(q.scale_bytes().clone(), codes.clone(), None if g is None else g.float().clone())

    def tensors(self) -> dict[str, Tensor]:
        out = {"scales": self.scale_bytes, "payload": self.payload}
        return out if self.global_scale is None else {**out, "global_scale": self.global_scale}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def num_elements(self, mode: str) -> int:
        """Elements per row (K) implied by the payload."""
        return self.payload.shape[-1] * ELEMENTS_PER_BYTE[mode]

    def check(self, fmt: FP4Format, mode: str, lead: tuple[int, ...], what: str) -> None:
        """Raise ValueError unless dtypes and shapes are consistent with each other, fmt, mode and lead."""
        for name, t in self.tensors().items():
            expected = torch.float32 if name == "global_scale" else torch.uint8
            if t.dtype != expected:
                raise ValueError(f"{what}: {name} has dtype {t.dtype}, expected {expected}")
        rows = tuple(self.payload.shape[:-1])
        if rows[: len(lead)] != lead or self.payload.dim() <= len(lead):
            raise ValueError(f"{what}: payload shape {tuple(self.payload.shape)} does not start with length {lead}")
        k = self.num_elements(mode)
        if k % fmt.block_size or tuple(self.scale_bytes.shape) != (*rows, k // fmt.block_size):
            raise ValueError(f"{what}: block scales of shape {tuple(self.scale_bytes.shape)} do not match "
                             f"{mode} payload of shape {tuple(self.payload.shape)} ({k} elements per row, "
                             f"blocks of {fmt.block_size})")
        has_global = fmt.kind == "nvfp4" and fmt.global_scale != "none"
        if has_global != (self.global_scale is not None):
            need = "needs" if has_global else "has no"
            raise ValueError(f"{what}: format {format_name(fmt)} {need} row global scales")
        if self.global_scale is not None and tuple(self.global_scale.shape) != (*rows, 1):
            raise ValueError(f"{what}: global scales of shape {tuple(self.global_scale.shape)}, expected {(*rows, 1)}")

    def bad_scales(self, fmt: FP4Format) -> tuple[Tensor, Tensor | None]:
        """Masks of the block scales and row global scales (None without) that no quantizer writes: NVFP4 block
        scales are positive finite E4M3 (clamped to >= 2^-6), row global scales positive finite (floored at
        2^-120), E8M0 has no NaN (0xFF)."""
        if fmt.kind == "mxfp4":
            block = self.scale_bytes == 0xFF
        else:
            # The positive finite E4M3 bytes are 0x01-0x7E (0x00 is zero, 0x7F NaN, the sign bit negative): one
            # wrapping byte subtraction and a compare, where decoding to float32 took ~2.9 s a 0.4 GB host record.
            block = (self.scale_bytes - 1) >= 0x7E
        g = self.global_scale
        return block, None if g is None else ~(torch.isfinite(g) & (g > 0))

    def check_scale_values(self, fmt: FP4Format, what: str) -> None:
        """Raise ValueError on a scale no quantizer writes (see ``bad_scales``)."""
        block, bad_global = self.bad_scales(fmt)
        if bool(block.any()):
            kind = "NaN (0xFF) E8M0 block scale" if fmt.kind == "mxfp4" else "NaN, zero or negative E4M3 block scale"
            raise ValueError(f"{what}: {int(block.sum())} {kind}(s), first at index {_first(block)}")
        if bad_global is not None and bool(bad_global.any()):
            g = self.global_scale
            assert g is not None
            raise ValueError(f"{what}: {int(bad_global.sum())} NaN, infinite, zero or negative row global scale(s), "
                             f"first at index {_first(bad_global)} ({float(g[bad_global][0])})")

    def ref(self, fmt: FP4Format, mode: str) -> BlockFP4:
        """The rollout's tensor for guided rounding; for parity records, codes whose bit 0 is the parity."""
        packed = self.payload if mode == "full" else pack_fp4(unpack_bits(self.payload))
        if fmt.kind == "mxfp4":
            return MXFP4(packed=packed, scales=self.scale_bytes.view(torch.float8_e8m0fnu), mode=fmt.mx_mode)
        return NVFP4(packed=packed, scales=self.scale_bytes.view(torch.float8_e4m3fn), global_scale=self.global_scale)

    def to_parity(self) -> SiteRecord:
        return replace(self, payload=pack_bits(unpack_fp4(self.payload) & 1))

    def time_slice(self, n: int) -> SiteRecord:
        """The first n positions (leading dim), for cutting a sequence to a training window."""
        g = None if self.global_scale is None else self.global_scale[:n]
        return SiteRecord(self.scale_bytes[:n], self.payload[:n], g)


@dataclass
class QuantRecord:
    """The FP4 record of one rollout sequence of length T (prompt + response positions)."""

    sites: dict[SiteKey, SiteRecord]
    """Per recorded (layer, site), tensors with leading dim T."""
    routes: Tensor
    """[L, T, top_k] routed expert ids of every layer, uint8 (or int16 beyond 256 experts)."""
    policy_version: int
    """Version of the weights that generated the sequence."""
    mode: str
    """"full" (4-bit codes) or "parity" (1 mantissa bit per element)."""
    fmt: FP4Format
    """Activation format of every recorded site (NVFP4 with row or no global scale, or MXFP4 with its mode)."""
    model_id: str = ""
    """``weights_fingerprint`` of the weights that generated the sequence ("" when unknown, which a consumer
    that expects a model refuses)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def length(self) -> int:
        """T, the number of token positions."""
        return int(self.routes.shape[1])

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.sites})

    def validate(self) -> None:
        """Raise ValueError if any tensor is inconsistent with the others or holds a value no rollout produces
        (never keep a half-valid record: a NaN scale or a duplicate expert would change the loss silently)."""
        check_guidance_mode(self.mode)
        if self.routes.dim() != 3 or self.routes.dtype not in (torch.uint8, torch.int16):
            raise ValueError(f"routes must be uint8/int16 [L, T, top_k], got {self.routes.dtype} "
                             f"{tuple(self.routes.shape)}")
        if self.length == 0 or self.routes.shape[0] == 0 or self.routes.shape[2] == 0:
            raise ValueError(f"empty record: routes of shape {tuple(self.routes.shape)} ([L, T, top_k] must all "
                             "be >= 1)")
        check_route_values(self.routes)
        for (layer, site), rec in self.sites.items():
            if not 0 <= layer < self.routes.shape[0]:
                raise ValueError(f"layer {layer} (site {site}) is outside the {self.routes.shape[0]} routed layers")
            what = f"layer {layer} site {site}"
            rec.check(self.fmt, self.mode, (self.length,), what)
            rec.check_scale_values(self.fmt, what)

    @classmethod
    def from_captures(cls, captures: Mapping[SiteKey, BlockFP4], routes: Tensor, policy_version: int,
                      mode: str = "full", layers: Iterable[int] | None = None, model_id: str = "") -> QuantRecord:
        """Build from the rollout's per-sequence captures {(layer, site): BlockFP4 [T, ...]} and routes [L, T, k].

        `layers` keeps only those layers (None: every captured layer); asking for an uncaptured layer is an
        error, since training would silently fall back to unguided rounding there.
        """
        check_guidance_mode(mode)
        keep = None if layers is None else set(layers)
        missing = (keep or set()) - {layer for layer, _ in captures}
        if missing:
            raise ValueError(f"layers {sorted(missing)} were requested but not captured")
        selected = {key: q for key, q in captures.items() if keep is None or key[0] in keep}
        formats = {format_of(q) for q in selected.values()}
        if len(formats) > 1:
            raise ValueError(f"captures mix formats {sorted(format_name(f) for f in formats)}")
        fmt = formats.pop() if formats else FP4Format()
        for key, q in selected.items():
            g = q.global_scale if isinstance(q, NVFP4) else None
            if g is not None and tuple(g.shape) != (*q.packed.shape[:-1], 1):
                raise ValueError(f"layer {key[0]} site {key[1]}: global scale must be per row, "
                                 f"got shape {tuple(q.global_scale.shape)}")
        sites = {key: SiteRecord.from_blocks(q, mode) for key, q in sorted(selected.items())}
        return cls(sites, compact_routes(routes), int(policy_version), mode, fmt, model_id)

    def ref(self, layer: int, site: str) -> BlockFP4:
        """The rollout's BlockFP4 [T, ...] at (layer, site), usable by guided_quantize in this record's mode."""
        if (layer, site) not in self.sites:
            raise KeyError(f"no record for layer {layer} site {site}; recorded layers: {self.layers}")
        return self.sites[(layer, site)].ref(self.fmt, self.mode)

    def tensors(self) -> dict[str, Tensor]:
        """Every payload tensor by its storage name; exactly what a serialized record holds."""
        out = {"routes": self.routes}
        for (layer, site), rec in self.sites.items():
            out.update({f"{layer}.{site}.{name}": t for name, t in rec.tensors().items()})
        return out

    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def bytes_per_token(self) -> float:
        """Serialized payload bytes (sites + routes, no header) per token position."""
        return self.payload_bytes() / max(self.length, 1)

    def bytes_per_token_by_layer(self) -> dict[int, float]:
        """Site payload bytes per token of each recorded layer (routes excluded), for layer budgets."""
        out: dict[int, float] = {}
        for (layer, _), rec in self.sites.items():
            out[layer] = out.get(layer, 0.0) + rec.nbytes / max(self.length, 1)
        return out

    def compact(self, mode: str | None = None, layers: Iterable[int] | None = None) -> QuantRecord:
        """A smaller record: only `layers`, and parity bits instead of codes if mode is "parity"."""
        mode = check_guidance_mode(mode or self.mode)
        if self.mode == "parity" and mode == "full":
            raise ValueError("a parity record cannot be expanded back to full codes")
        keep = None if layers is None else set(layers)
        sites = {k: (r.to_parity() if mode != self.mode else r) for k, r in self.sites.items()
                 if keep is None or k[0] in keep}
        return QuantRecord(sites, self.routes, self.policy_version, mode, self.fmt, self.model_id)


def view_to(t: Tensor, device: torch.device | str) -> Tensor:
    """t on `device`, asynchronously where t lies in pinned memory, also where it is a strided view of it (a record's
    training window, a micro-batch's rows of it). Torch's own copy of such a view first gathers it into pageable
    memory on the host, then copies that synchronously: the host, which enqueues the forward, stood still for each
    micro-batch's record (30 MB a sequence: medium-moe's parity records of every layer at 1K tokens)."""
    if not t.is_pinned() or t.is_contiguous() or t.numel() == 0:
        return t.to(device, non_blocking=t.is_pinned())
    return _strided_to(t, device)


def _strided_to(t: Tensor, device: torch.device | str) -> Tensor:
    """A strided view t (pinned) on `device` by asynchronous copies: the span of memory it covers where its gaps are
    short (rows of a window), else a pinned gather of it first (a thin slice across a large tensor: routes' rows)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    if span <= 2 * t.numel():
        moved = t.as_strided((span,), (1,)).to(device, non_blocking=True)
        return moved.as_strided(t.shape, t.stride(), moved.storage_offset())
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.device(device).type == "cuda").copy_(t)
    return staged.to(device, non_blocking=True)


def route_dtype(n_experts: int) -> torch.dtype:
    """The smallest dtype that holds the expert ids of a model with n_experts experts."""
    if n_experts > 2**15:
        raise ValueError(f"expert ids must lie in 0..32767, the model has {n_experts} experts")
    return torch.uint8 if n_experts <= 256 else torch.int16


def compact_routes(routes: Tensor) -> Tensor:
    """Expert ids [L, T, k] in the smallest dtype that holds them (uint8 below 256 experts, else int16)."""
    if routes.dim() != 3:
        raise ValueError(f"routes must be [L, T, top_k], got shape {tuple(routes.shape)}")
    if routes.dtype in (torch.uint8, torch.int16):
        return routes.clone()
    low, top = (int(routes.min()), int(routes.max())) if routes.numel() else (0, 0)
    if low < 0 or top >= 2**15:
        raise ValueError(f"expert ids must lie in 0..32767, got {low}..{top}")
    return routes.to(torch.uint8 if top < 256 else torch.int16)


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _picked_twice(ids: Tensor) -> Tensor:
    """Expert ids [..., top_k] -> [...] True where one token picked an expert twice."""
    ordered = ids.sort(dim=-1).values
    return (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)


def check_route_values(routes: Tensor, n_experts: int | None = None) -> None:
    """Raise ValueError on a negative or (given n_experts) out-of-range expert id, or an expert picked twice by
    one token: training would route through an expert the rollout never used."""
    ids = routes.long()
    if bool((ids < 0).any()):
        raise ValueError(f"negative expert id {int(ids.min())} in routes (layer, position, slot {_first(ids < 0)})")
    if n_experts is not None and bool((ids >= n_experts).any()):
        raise ValueError(f"expert id {int(ids.max())} is outside the model's {n_experts} experts (layer, "
                         f"position, slot {_first(ids >= n_experts)})")
    twice = _picked_twice(ids)  # (L, T)
    if bool(twice.any()):
        layer, pos = _first(twice)
        raise ValueError(f"duplicate expert ids {ids[layer, pos].tolist()} at layer {layer} position {pos}")


@dataclass(frozen=True)
class ModelIdentity:
    """What a record must match to be used for a model: its weights and its routing shape."""

    fingerprint: str
    n_layers: int
    n_experts: int
    top_k: int

    @classmethod
    def of(cls, config: Any, named_weights: Mapping[str, Tensor]) -> ModelIdentity:
        """The identity of a model config (MoEConfig) holding these weights."""
        fingerprint = weights_fingerprint(tensor_digests(named_weights))
        return cls(fingerprint, config.n_layers, config.n_experts, config.top_k)

    def check(self, record: QuantRecord) -> None:
        """Raise ValueError unless the record was generated by this model (same weights, layers, top-k, experts)."""
        if record.model_id != self.fingerprint:
            got = record.model_id[:12] or "none"
            raise ValueError(f"record comes from another model or checkpoint (fingerprint {got}, expected "
                             f"{self.fingerprint[:12]})")
        n_layers, _, top_k = record.routes.shape
        if (n_layers, top_k) != (self.n_layers, self.top_k):
            raise ValueError(f"record routes are for {n_layers} layers with top-{top_k}, the model has "
                             f"{self.n_layers} layers with top-{self.top_k}")
        check_route_values(record.routes, self.n_experts)


@dataclass
class BatchRecord:
    """Records of a minibatch as one uint8 tensor [B, T, width] (see ``RecordLayout``), with routes and the mask of
    positions that have a record. Positions without one hold the layout's pad row (+0 codes under unit scales:
    finite, never NaN), and the hook falls back to plain fake-quant there.

    The rollout engine builds it on its device while decoding (no per-sequence objects); the bytes transport builds
    it with ``collate_records``. Sites are read as views of ``data``; ``ref`` makes the contiguous tensor guided
    rounding reads, once per site.
    """

    data: Tensor
    """uint8 [B, T, layout.width]: every recorded site of every position."""
    routes: Tensor
    """[L, B, T, top_k] routed expert ids, uint8 (int16 beyond 256 experts); positions without a record hold
    0..top_k-1."""
    valid: Tensor
    """(B, T) bool: True where the position has a rollout record."""
    layout: RecordLayout
    policy_versions: list[int]
    model_id: str = ""
    """``weights_fingerprint`` of the weights that generated the batch ("" when unknown)."""
    _refs: dict[SiteKey, BlockFP4] = field(default_factory=dict, repr=False)

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def fmt(self) -> FP4Format:
        return self.layout.fmt

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.layout.keys})

    @property
    def sites(self) -> dict[SiteKey, SiteRecord]:
        """Per recorded (layer, site), views of ``data`` with leading dims (B, T)."""
        return {key: SiteRecord(*fields) for key, fields in self.layout.views(self.data).items()}

    def has(self, layer: int, site: str) -> bool:
        return (layer, site) in self.layout.keys

    def ref(self, layer: int, site: str) -> BlockFP4:
        """The rollouts' BlockFP4 (B, T, ...) at (layer, site); padded rows hold +0 codes under unit scales."""
        key = (layer, site)
        if not self.has(layer, site):
            raise KeyError(f"no record for layer {layer} site {site}; recorded layers: {self.layers}")
        if key not in self._refs:
            scales, payload, g = self.layout.view(self.data, key)
            site_record = SiteRecord(scales.contiguous(), payload.contiguous(), None if g is None else g.contiguous())
            self._refs[key] = site_record.ref(self.fmt, self.mode)
        return self._refs[key]

    def to(self, device: torch.device | str) -> BatchRecord:
        """This batch on `device` (itself when already there): one copy of the packed bytes, asynchronous from
        pinned host memory (the host goes on enqueueing the forward; the device's stream orders the copy before
        the kernels that read it)."""
        if self.valid.device == torch.device(device):
            return self
        return replace(self, data=view_to(self.data, device), routes=view_to(self.routes, device),
                       valid=view_to(self.valid, device), _refs={})

    def window(self, length: int) -> BatchRecord:
        """The first `length` positions (views), e.g. a rollout's record cut to the training forward's width."""
        if length > self.length:
            raise ValueError(f"window of {length} positions of a {self.length}-position record")
        return replace(self, data=self.data[:, :length], routes=self.routes[:, :, :length],
                       valid=self.valid[:, :length], _refs={})

    def rows(self, rows: slice) -> BatchRecord:
        """Sequences `rows` (views): a micro-batch's record."""
        return replace(self, data=self.data[rows], routes=self.routes[:, rows], valid=self.valid[rows],
                       policy_versions=self.policy_versions[rows], _refs={})

    def compact(self, mode: str | None = None, layers: Iterable[int] | None = None,
                sites: Iterable[str] | None = None) -> BatchRecord:
        """A smaller batch record on the same device: only `layers` and `sites` (None: all), and parity bits instead
        of codes if mode is "parity" (one repack of the bytes, no per-sequence work)."""
        keep = None if layers is None else set(layers)
        keep_sites = None if sites is None else set(sites)
        keys = [key for key in self.layout.keys
                if (keep is None or key[0] in keep) and (keep_sites is None or key[1] in keep_sites)]
        layout = self.layout.select(keys, check_guidance_mode(mode or self.mode))
        if layout == self.layout:
            return self
        return replace(self, data=layout.repack(self.data, self.layout), layout=layout, _refs={})

    def routes_for_replay(self) -> list[Tensor]:
        """Per layer (B, T, top_k) int64 expert ids for the model's ``routed=`` argument."""
        return list(self.routes.long().unbind(0))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.routes.nbytes

    def payload_bytes(self) -> int:
        """Bytes of record the valid positions carry (site slots and routes, no alignment slack, no padding)."""
        per_token = self.layout.payload_bytes_per_token + self.routes.shape[0] * self.routes.shape[3] * \
            self.routes.element_size()
        return int(self.valid.sum()) * per_token

    def sequence(self, i: int) -> QuantRecord:
        """Sequence i's record (its valid positions, copied to the CPU): what the bytes transport or a file holds."""
        n = int(self.valid[i].sum())
        data = self.data[i, :n].cpu()
        sites = {key: SiteRecord(scales.clone(), payload.clone(), None if g is None else g.clone())
                 for key, (scales, payload, g) in self.layout.views(data).items()}
        return QuantRecord(sites, self.routes[:, i, :n].cpu().clone(), self.policy_versions[i], self.mode, self.fmt,
                           self.model_id)

    def check(self, *, expected_version: int | None = None, model: ModelIdentity | None = None) -> None:
        """Raise ValueError if the batch is stale, from another model, or holds a value no rollout produces (a NaN
        scale, an out-of-range or repeated expert): the device transport's counterpart of ``load_record``'s checks,
        vectorized over the batch with one host sync when everything is right."""
        self.check_identity(expected_version=expected_version, model=model)
        self.check_values(None if model is None else model.n_experts)

    def check_identity(self, *, expected_version: int | None = None, model: ModelIdentity | None = None) -> None:
        """``check``'s part that reads no record bytes (versions, fingerprint, shapes): immediate at any size."""
        if expected_version is not None and min(self.policy_versions) < expected_version:
            raise ValueError(f"stale record: policy version {min(self.policy_versions)} is older than the expected "
                             f"{expected_version}")
        if model is not None:
            if self.model_id != model.fingerprint:
                raise ValueError(f"record comes from another model or checkpoint (fingerprint "
                                 f"{self.model_id[:12] or 'none'}, expected {model.fingerprint[:12]})")
            n_layers, top_k = self.routes.shape[0], self.routes.shape[3]
            if (n_layers, top_k) != (model.n_layers, model.top_k):
                raise ValueError(f"record routes are for {n_layers} layers with top-{top_k}, the model has "
                                 f"{model.n_layers} layers with top-{model.top_k}")

    def check_values(self, n_experts: int | None = None) -> None:
        """``check``'s scan of every scale and route: seconds for gigabytes of record in host memory, which a
        caller may run beside the training step's device work (lit.callbacks.CacheExchange)."""
        ids = self.routes.long()
        flags = [(ids < 0).any(), _picked_twice(ids).any()]
        flags += [] if n_experts is None else [(ids >= n_experts).any()]
        for rec in self.sites.values():
            flags += [mask.any() for mask in rec.bad_scales(self.fmt) if mask is not None]
        if not bool(torch.stack(flags).any()):  # the one host sync when everything is right
            return
        for (layer, site), rec in self.sites.items():
            rec.check_scale_values(self.fmt, f"layer {layer} site {site}")
        check_route_values(self.routes.flatten(1, 2), n_experts)


def collate_records(records: Sequence[QuantRecord], pad_to: int | None = None) -> BatchRecord:
    """Pack per-sequence records into a BatchRecord of length pad_to (default: the longest record).

    Records longer than pad_to are cut to it (the training window never sees later positions). Positions past a
    record's end hold the layout's pad row and are marked invalid.
    """
    if not records:
        raise ValueError("collate_records needs at least one record")
    first = records[0]
    length = max(r.length for r in records) if pad_to is None else int(pad_to)
    for i, r in enumerate(records):
        if (r.mode, r.fmt) != (first.mode, first.fmt):
            raise ValueError(f"record {i} is {r.mode}/{format_name(r.fmt)}, record 0 is "
                             f"{first.mode}/{format_name(first.fmt)}")
        if set(r.sites) != set(first.sites) or r.routes.shape[::2] != first.routes.shape[::2]:
            raise ValueError(f"record {i} covers other sites or routes than record 0")
    per_elem = ELEMENTS_PER_BYTE[first.mode]
    layout = RecordLayout.build(first.fmt, first.mode, {
        key: (tuple(rec.payload.shape[1:-1]), rec.payload.shape[-1] * per_elem) for key, rec in first.sites.items()})
    device = first.routes.device
    data = layout.pad_row(device).expand(len(records), length, layout.width).clone()
    n_layers, top_k = first.routes.shape[0], first.routes.shape[2]
    routes = torch.arange(top_k, dtype=first.routes.dtype, device=device)
    routes = routes.expand(n_layers, len(records), length, top_k).clone()
    valid = torch.zeros(len(records), length, dtype=torch.bool, device=device)
    for b, r in enumerate(records):
        n = min(r.length, length)
        tokens = b * length + torch.arange(n, device=device)
        for key, rec in r.sites.items():
            shapes, ours = (rec.payload.shape[1:], rec.scale_bytes.shape[1:]), first.sites[key]
            if shapes != (ours.payload.shape[1:], ours.scale_bytes.shape[1:]):
                raise ValueError(f"record {b} layer {key[0]} site {key[1]}: rows of another shape than record 0's")
            g = None if rec.global_scale is None else rec.global_scale[:n].reshape(n, -1)
            write_record_slot(data, tokens, rec.payload[:n].reshape(n, -1), rec.scale_bytes[:n].reshape(n, -1), g,
                              layout.slot(key).offset, parity=False)  # the payload is already in the record's mode
        routes[:, b, :n] = r.routes[:, :n]
        valid[b, :n] = True
    model_ids = {r.model_id for r in records}
    return BatchRecord(data, routes, valid, layout, [r.policy_version for r in records],
                       model_ids.pop() if len(model_ids) == 1 else "")
