"""FP4 activations on the rollout side, and the record of how they were rounded.

The hook quantizes each site's input per row (row global scale, so a token never depends on its batch)
and returns the dequantized values in the compute dtype: this is what the FP4 kernels compute with.
When a (layer, site) is being recorded, the very BlockFP4 it used is written, packed in the capture's mode
(guidance/layout.py), into its slot of a record tensor indexed by token position, so right-padded prefill
rows and later decode rows land where they belong and padding is overwritten by the real token at that
position. K and V are not quantized here: the FP4 KV cache
quantizes them as it stores them, and hands its bytes to the same recorder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from trace_lightning import sim
from trace_lightning.guidance.layout import RecordLayout
from trace_lightning.guidance.record import BatchRecord, route_dtype
from trace_lightning.model.hooks import QuantHook
from trace_lightning.quant import NVFP4, BlockFP4
from trace_lightning.rollout.batch import SiteKey

RowQuantizer = Callable[[Tensor], BlockFP4]
RowFakeQuantizer = Callable[[Tensor], tuple[Tensor, BlockFP4]]
KV_SITES = frozenset({"k", "v"})


def batch_rows(positions: Tensor) -> Tensor:
    """(B, T) positions -> (B, T) batch index of each, for writes at [row, position]."""
    return torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)


def reshape_rows(q: BlockFP4, lead: tuple[int, ...]) -> BlockFP4:
    """View every tensor field of q [M, ...] as [*lead, ...]."""
    changes = {f.name: v.reshape(*lead, *v.shape[1:]) for f in dataclasses.fields(q)
               if isinstance(v := getattr(q, f.name), Tensor)}
    return dataclasses.replace(q, **changes)


def quantize_rows(quantize: RowQuantizer, x: Tensor) -> BlockFP4:
    """Quantize x [..., K] as rows [M, K] (the kernels' layout) and give the result x's leading dims."""
    return reshape_rows(quantize(x.reshape(-1, x.shape[-1])), tuple(x.shape[:-1]))


def fake_quantizer(quantize: RowQuantizer) -> RowFakeQuantizer:
    """(dequantized value in x's dtype, BlockFP4) from a plain quantizer, for backends without a fused one."""

    def fake(x: Tensor) -> tuple[Tensor, BlockFP4]:
        q = quantize(x)
        return q.dequantize(x.dtype), q

    return fake


class RowBuffer:
    """BlockFP4 rows stored at token positions: every tensor field becomes a buffer [B, S, ...].

    Allocated on the first write (from that tensor's field shapes); 1-byte float fields (E4M3 / E8M0
    scales) are kept as their uint8 bit patterns so that indexed writes work on every device.
    """

    def __init__(self, batch: int, max_len: int) -> None:
        self.batch, self.max_len = batch, max_len
        self.template: BlockFP4 | None = None
        self.buffers: dict[str, Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}

    def _allocate(self, q: BlockFP4) -> None:
        self.template = q
        for f in dataclasses.fields(q):
            t = getattr(q, f.name)
            if isinstance(t, Tensor):
                store = torch.uint8 if t.is_floating_point() and t.element_size() == 1 else t.dtype
                self.buffers[f.name] = torch.zeros(self.batch, self.max_len, *t.shape[2:], dtype=store,
                                                   device=t.device)
                self.dtypes[f.name] = t.dtype

    def write(self, q: BlockFP4, positions: Tensor) -> None:
        """Store q (leading dims (B, T)) at positions (B, T) of its batch rows."""
        if self.template is None:
            self._allocate(q)
        rows = batch_rows(positions)
        for name, buf in self.buffers.items():
            t = getattr(q, name)
            buf[rows, positions] = t.view(buf.dtype) if t.dtype != buf.dtype else t

    def _build(self, index: Any) -> BlockFP4:
        assert self.template is not None, "nothing was written"
        fields = {name: buf[index].view(self.dtypes[name]) for name, buf in self.buffers.items()}
        return dataclasses.replace(self.template, **fields)

    def window(self, n: int) -> BlockFP4:
        """Positions 0..n-1 of every row, leading dims (B, n) (views, no copy)."""
        return self._build((slice(None), slice(0, n)))


def ring_runs(positions: Tensor, rows: Tensor) -> list[tuple[int, int, int, int, int]]:
    """(forward row, first ring column, output row, first position, length) of each run of a ring's columns that
    holds consecutive positions of one output row; `positions` [B, C] (-1: unused) and `rows` [B, C], on the host."""
    used = positions >= 0
    follows = torch.zeros_like(used)
    follows[:, 1:] = used[:, 1:] & used[:, :-1] & (positions[:, 1:] == positions[:, :-1] + 1) & (
        rows[:, 1:] == rows[:, :-1])
    starts = used & ~follows
    fwd_rows, columns = starts.nonzero(as_tuple=True)
    run_of = (starts.flatten().cumsum(0) - 1)[used.flatten()]  # runs never cross a forward row: follows[:, 0] is False
    lengths = torch.bincount(run_of, minlength=len(fwd_rows))
    return list(zip(fwd_rows.tolist(), columns.tolist(), rows[fwd_rows, columns].tolist(),
                    positions[fwd_rows, columns].tolist(), lengths.tolist(), strict=True))


class _ForwardInput:
    """A Recorder attribute the engine sets before a forward (a tensor or None): setting it drops the target
    computed for the last forward."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.name)

    def __set__(self, obj: Any, value: Tensor | None) -> None:
        setattr(obj, self.name, value)
        obj._targets = None


class Recorder:
    """Writes the requested (layer, site) FP4 rows, packed by ``layout``, and every layer's routes, by token position.

    The record is one preallocated tensor indexed by sequence and position, [N, S, layout.width] (parity bits or
    codes, as the layout says, with the scales), and the routes another, [L, N, S, top_k]. The engine sets
    ``positions`` (B, T) before each forward; the hook, the FP4 experts and the FP4 cache call ``observe``. With
    continuous batching a forward's batch rows are cache slots, not sequences: the engine then also sets ``rows``
    (B,), the sequence (output row) of each batch row.

    With ``ring`` columns (``CaptureSpec.stream_to_host``) the record lives in host memory (pinned on a GPU) and
    the device holds only a ring [B, ring, width]: a prefill writes at its positions, a decode step at column
    (step - 1) % ring of the step counter ``step`` (a device tensor, so a CUDA graph replays it), and ``flush``
    copies what the ring holds to its (sequence, position) rows at every host check, so device memory is bounded
    by the prompt length and the check interval whatever the response length.
    """

    def __init__(self, layout: RecordLayout | None, batch: int, max_len: int, n_layers: int, top_k: int,
                 n_experts: int, device: torch.device, ops: ModuleType | None = None, *, rows: int | None = None,
                 ring: int = 0) -> None:
        self.layout = layout
        self.write_slot = (ops or sim).write_record_slot  # one Triton launch a site on the GPU
        self.slots = {s.key: s for s in layout.slots} if layout is not None else {}
        self.batch, self.max_len = batch, max_len
        self.length = max_len
        """The positions of the current generate call (<= max_len: a kept decode session's buffers may be longer)."""
        self.kept = False
        """The buffers outlive the call (a kept decode session): the record is handed over as a copy."""
        self._targets: tuple[Tensor, Tensor] | None = None
        """_target's answer for the current forward: every recorded site of a forward writes the same tokens."""
        self.positions: Tensor | None = None
        self.rows: Tensor | None = None
        self.step: Tensor | None = None
        self.observed: set[SiteKey] = set()
        width = layout.width if layout is not None else 0
        streaming = ring > 0 and layout is not None
        with torch.inference_mode(False):  # training reads (and may modify) these: normal tensors
            self.data = torch.zeros(batch, max_len, width, dtype=torch.uint8,
                                    device="cpu" if streaming else device,
                                    pin_memory=streaming and device.type == "cuda")
            self.routes = torch.zeros(n_layers, batch, max_len, top_k, dtype=route_dtype(n_experts), device=device)
        self.ring: Tensor | None = None
        if streaming:
            fwd_rows = batch if rows is None else rows
            self.ring = torch.zeros(fwd_rows, ring, width, dtype=torch.uint8, device=device)
            self.ring_pos = torch.full((fwd_rows, ring), -1, dtype=torch.long, device=device)
            self.ring_row = torch.zeros((fwd_rows, ring), dtype=torch.long, device=device)

    positions = _ForwardInput()
    """(B, T) positions of the current forward (the engine sets them before each forward)."""
    rows = _ForwardInput()
    """(B,) output row of each batch row (continuous batching); None: batch row b is output row b."""
    step = _ForwardInput()
    """The decode step counter ((1,) or one per slot) while decoding; None during a prefill."""

    def begin(self, length: int) -> None:
        """A generate call of up to `length` positions starts in these buffers (what an earlier call wrote there is
        cut off or overwritten: its positions past a row's length are filled at hand-over)."""
        if length > self.max_len:
            raise ValueError(f"a call of {length} positions does not fit a recorder of {self.max_len}")
        self.length = length
        self.positions = self.rows = self.step = None
        self.observed.clear()

    def output_rows(self) -> Tensor:
        """(B, T) output row of each token of the current forward: ``rows[b]`` when set, else b."""
        assert self.positions is not None, "set Recorder.positions before the forward"
        if self.rows is None:
            return batch_rows(self.positions)
        return self.rows[:, None].expand_as(self.positions)

    def observe(self, q: BlockFP4, *, layer: int, site: str) -> None:
        """Write q (leading dims (B, T) of the current forward) into its slot if (layer, site) is recorded."""
        slot = self.slots.get((layer, site))
        if slot is None:
            return
        target, tokens = self._target()
        m, parity = tokens.numel(), self.layout is not None and self.layout.mode == "parity"
        g = q.global_scale.reshape(m, -1) if slot.global_bytes and isinstance(q, NVFP4) else None
        packed, scales = q.packed.reshape(m, -1), q.scale_bytes().reshape(m, -1)
        size = 4 * (0 if g is None else g.shape[1]) + scales.shape[1] + packed.shape[1] // (4 if parity else 1)
        if size != slot.size:
            raise ValueError(f"layer {layer} site {site}: {size} record bytes a token, the layout has {slot.size}")
        self.write_slot(target, tokens, packed, scales, g, slot.offset, parity)
        self.observed.add(slot.key)

    def _columns(self) -> Tensor:
        """(B, T) ring column of every position of the current forward."""
        assert self.positions is not None and self.ring is not None
        if self.step is None:
            return self.positions
        return ((self.step - 1) % self.ring.shape[1]).view(-1, 1).expand_as(self.positions)

    def _target(self) -> tuple[Tensor, Tensor]:
        """(tensor written, (B * T,) rows of it viewed [-1, width]) for the current forward: computed at its first
        recorded site and shared by the others (a few small kernels a site were ~100 launches a decode step)."""
        assert self.positions is not None, "set Recorder.positions before the forward"
        if self._targets is None:
            if self.ring is None:
                self._targets = self.data, (self.output_rows() * self.max_len + self.positions).reshape(-1)
            else:
                columns = self._columns()
                self._targets = self.ring, (batch_rows(self.positions) * self.ring.shape[1] + columns).reshape(-1)
        return self._targets

    def flush(self) -> None:
        """Copy what the ring holds to the host record (one device sync) and empty it; a no-op without a ring.

        Each run of ring columns that holds consecutive positions of one sequence is one contiguous copy, straight
        into the (pinned) host record, asynchronous on the device's stream: a few hundred copies a check. Gathering
        the ring on the host and scattering it byte by byte took 14 ms a decode step at 256 rows of 29 KB
        (medium-moe, every layer's parity record; H100, 2026-12-06), twice the FP4 step itself."""
        if self.ring is not None:
            self._flush(self.ring_pos.cpu())

    def check(self, steps_ahead: int) -> None:
        """At a host check: flush only if the ring may not hold the `steps_ahead` decode steps before the next
        check (each step writes one column of every row). A ring of several checks' columns is then flushed every
        few checks, in longer runs: a check with nothing to copy costs the read of the ring's positions, where a
        flush enqueues one copy per sequence (256 at the long fit, ~4 ms of host time with the device idle)."""
        if self.ring is None:
            return
        positions = self.ring_pos.cpu()
        if int((positions >= 0).sum(1).max()) + steps_ahead > self.ring.shape[1]:
            self._flush(positions)

    def _flush(self, positions: Tensor) -> None:
        assert self.ring is not None
        used = positions >= 0
        if not bool(used.any()):
            return
        rows = self.ring_row.cpu()
        for fwd_row, column, row, position, n in ring_runs(positions, rows):
            self.data[row, position:position + n].copy_(self.ring[fwd_row, column:column + n], non_blocking=True)
        self.ring_pos.fill_(-1)

    def _await_host_copies(self) -> None:
        """Wait for flush's asynchronous copies before the host reads or writes the record."""
        if self.ring is not None and self.ring.is_cuda:
            torch.cuda.current_stream(self.ring.device).synchronize()

    def observe_routes(self, routes: list[Tensor]) -> None:
        """Per layer (B, T, K) expert ids of the current forward (and, streaming, where the ring's columns go)."""
        self.routes[:, self.output_rows(), self.positions] = torch.stack(routes).to(self.routes.dtype)
        if self.ring is not None and self.slots:
            rows, columns = batch_rows(self.positions), self._columns()
            self.ring_pos[rows, columns] = self.positions
            self.ring_row[rows, columns] = self.output_rows()

    def valid(self, lengths: Tensor) -> Tensor:
        """(B, S) True at the positions 0 .. lengths[b] - 1 each row fed through the model (S: the call's length)."""
        return torch.arange(self.length, device=lengths.device) < lengths[:, None]

    def route_table(self, lengths: Tensor) -> Tensor:
        """[L, B, S, top_k] routes (a new tensor); positions past a row's length hold 0 .. top_k - 1 (a valid,
        distinct set)."""
        fill = torch.arange(self.routes.shape[-1], dtype=self.routes.dtype, device=self.routes.device)
        return torch.where(self.valid(lengths)[None, :, :, None], self.routes[:, :, : self.length], fill)

    def batch_record(self, lengths: Tensor, routes: Tensor, policy_version: int, model_id: str) -> BatchRecord:
        """The record of the whole call (with `routes`, the call's ``route_table``): positions past a row's length
        hold the pad row."""
        assert self.layout is not None, "no capture was requested"
        missing = sorted(set(self.slots) - self.observed)
        if missing:
            raise RuntimeError(f"record sites {missing} were laid out but never quantized by the forward")
        self._await_host_copies()
        valid = self.valid(lengths.to(self.data.device))
        data = self.data[:, : self.length]
        data[~valid] = self.layout.pad_row(self.data.device)  # in place: the record is handed over as is (or copied)
        if self.kept:
            data = data.clone()  # on the device: a kept session is never streamed to the host (Engine._kept_length)
        return BatchRecord(data, _beside(routes, data), _beside(valid, data), self.layout,
                           [policy_version] * self.batch, model_id)


def _beside(t: Tensor, data: Tensor) -> Tensor:
    """t (routes or valid: small) where the record's bytes `data` are, pinned if they are, so every copy of the
    record to the device can be asynchronous: one copy straight into pinned memory, not to the host and then
    pinned."""
    if not data.is_pinned():
        return t.to(data.device)
    if t.is_pinned():
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


class FP4ActivationHook(QuantHook):
    """Rollout-side FP4 activations: per-row quantize, record if asked, return dequantized compute-dtype values.

    ``fake_quantize`` maps rows [M, K] to (value, BlockFP4) in one pass (``ops.fake_quantize_nvfp4_rows``).
    Sites in ``passthrough`` (k and v: the FP4 cache quantizes those) are returned unchanged. Weights are
    left alone here: the FP4 converter has already replaced the modules that hold them.
    """

    def __init__(self, fake_quantize: RowFakeQuantizer, recorder: Recorder | None = None,
                 passthrough: frozenset[str] = KV_SITES) -> None:
        self.fake_quantize, self.recorder, self.passthrough = fake_quantize, recorder, passthrough

    def quantizes(self, site: str) -> bool:
        return site not in self.passthrough

    def observe(self, q: BlockFP4, *, layer: int, site: str) -> None:
        """Record a tensor that a fused op quantized on its own (e.g. fp4_moe's moe_down)."""
        if self.recorder is not None:
            self.recorder.observe(q, layer=layer, site=site)

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        if site in self.passthrough:
            return x
        value, q = self.fake_quantize(x.reshape(-1, x.shape[-1]))
        self.observe(reshape_rows(q, tuple(x.shape[:-1])), layer=layer, site=site)
        return value.view(x.shape)
