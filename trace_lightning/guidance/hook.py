"""Training-side quantization hooks: plain fake-quant (the ``fp4_qat`` baseline) and rollout-guided fake-quant.

The guided hook makes the training forward round every recorded activation to the rollout's FP4 code
with the rollout's scales (DESIGN.md section 5), so the policy being trained sees the numbers the
rollout sampled with. Sites without a record, and padded positions, fall back to plain round-to-nearest
with training's own scales. Weights are always fake-quantized per matrix (``fmt.for_weights()``), the
same quantizer the rollout engine applies to the synced weights, so weight codes agree by construction.
Both hooks can audit themselves against full records: how often training's own RNE codes, and the
values it actually used, agree with the rollout's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trace_lightning.guidance.record import BatchRecord, format_name
from trace_lightning.model import QuantHook
from trace_lightning.quant import FakeQuantCache, FP4Format, fake_quantize, parse_format
from trace_lightning.quant import fake as fake_module
from trace_lightning.quant.fake import own_rounding, straight_through, with_own_rounding
from trace_lightning.quant.guided import check_guidance_mode


class NonFiniteActivationError(RuntimeError):
    """An activation reaching a quantization site holds NaN or inf (the trainer adds the step)."""

    layer: int | None = None
    site: str | None = None

    @classmethod
    def at(cls, layer: int, site: str) -> NonFiniteActivationError:
        err = cls(f"non-finite activation at layer {layer}, site {site}")
        err.layer, err.site = layer, site
        return err


@dataclass
class SiteAgreement:
    """Element counts of one site's audit against the rollout's full record."""

    elements: int = 0
    code_equal: int = 0
    """Training's own RNE codes equal to the rollout's (codes 0 and 8, +-0, count as equal)."""
    value_equal: int = 0
    """Values the training forward used equal to the rollout's dequantized values (+0 == -0, NaN never)."""

    @property
    def code_agreement(self) -> float:
        return self.code_equal / max(self.elements, 1)

    @property
    def value_agreement(self) -> float:
        return self.value_equal / max(self.elements, 1)


def _expand_mask(mask: Tensor, x: Tensor) -> Tensor:
    """(B, T) -> x's shape."""
    return mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim()))).expand(x.shape)


def _check_leading(x: Tensor, mask: Tensor, layer: int, site: str) -> None:
    if tuple(x.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"layer {layer} site {site}: activation of shape {tuple(x.shape)} does not match "
                         f"the record's (B, T) = {tuple(mask.shape)}")


class FiniteCheckHook(QuantHook):
    """The identity at every site, but refuses a non-finite activation, naming its layer and site.

    Immediately (inside the forward) by default. With ``deferred`` each site leaves its largest magnitude on the
    device (one reduction, NaN where x holds NaN; ``isfinite(x).all()`` is five launches and four passes over x) and
    ``raise_if_nonfinite``, called after the forward, reads them all with one host sync and raises for the first
    bad site: on a GPU a sync per site would drain the launch queue some fifty times a forward.
    """

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._flags: list[tuple[int, str, Tensor]] = []

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        self.check_finite(x, layer, site)
        return x

    def check_finite(self, x: Tensor, layer: int, site: str) -> None:
        if self.deferred:
            if x.numel():  # an empty site holds nothing non-finite (and has no largest magnitude)
                self._flags.append((layer, site, torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32)))
        elif not bool(torch.isfinite(x).all()):
            raise NonFiniteActivationError.at(layer, site)

    def raise_if_nonfinite(self) -> None:
        """Raise NonFiniteActivationError for the first site whose deferred check failed (one host sync)."""
        pending = self.take_verdicts()
        if pending is None:
            return
        finite, sites = pending
        for (layer, site), ok in zip(sites, finite.tolist(), strict=True):
            if not ok:
                raise NonFiniteActivationError.at(layer, site)

    def take_verdicts(self) -> tuple[Tensor, list[tuple[int, str]]] | None:
        """The deferred checks so far, still on the device: (whether each site was finite, its (layer, site)), in
        the forward's order, for a caller that reads many forwards' at once (None if nothing was checked)."""
        flags, self._flags = self._flags, []
        if not flags:
            return None
        return torch.isfinite(torch.stack([f for *_, f in flags])), [(layer, site) for layer, site, _ in flags]


class _FP4TrainHook(FiniteCheckHook):
    """Shared by both hooks: weight fake-quant, the finite check and the optional audit."""

    def __init__(self, fmt: FP4Format | str, audit: BatchRecord | None = None,
                 valid_mask: Tensor | None = None, weights: FakeQuantCache | None = None) -> None:
        super().__init__()
        self.weights = FakeQuantCache() if weights is None else weights
        """Fake-quantized weights; the trainer passes one cache to all micro-batches of a step."""
        self.fmt = parse_format(fmt)
        self.weight_fmt = self.fmt.for_weights()
        self.valid_mask = None if valid_mask is None else valid_mask.bool()
        if audit is not None and audit.mode != "full":
            raise ValueError("auditing code agreement needs a full record; parity records do not hold the codes")
        if audit is not None and audit.fmt != self.fmt:
            raise ValueError(f"audit record is {format_name(audit.fmt)}, training uses {format_name(self.fmt)}")
        self.audit_record = audit
        self._agreement: dict[tuple[int, str], SiteAgreement] = {}
        self._pending: dict[tuple[int, str], Tensor] = {}
        """Audit counts (elements, code_equal, value_equal) still on the device: read with one host sync."""

    def weight(self, w: Tensor, *, layer: int, name: str) -> Tensor:
        # Rounding to the per-matrix quantization's own codes is plain RNE fake-quant, with its STE gradient.
        return self.weights.fake_quantize(w, self.weight_fmt, layer=layer, name=name)

    def _mask(self, record: BatchRecord, x: Tensor, layer: int, site: str) -> Tensor:
        """Positions where `record` may be used: recorded and (if given) real tokens."""
        _check_leading(x, record.valid, layer, site)
        valid = record.valid
        return valid if self.valid_mask is None else valid & self.valid_mask.to(x.device)

    @torch.no_grad()
    def _audit(self, x: Tensor, out: Tensor, layer: int, site: str) -> None:
        if self.audit_record is None or not self.audit_record.has(layer, site):
            return
        self.audit_record = self.audit_record.to(x.device)
        mask = _expand_mask(self._mask(self.audit_record, x, layer, site), x)
        ref = self.audit_record.ref(layer, site)
        own, theirs = own_rounding(x, self.fmt).codes(), ref.codes()
        code_eq = (own == theirs) | (((own & 7) == 0) & ((theirs & 7) == 0))
        value_eq = out == ref.dequantize(out.dtype)
        counts = torch.stack([mask.sum(), (code_eq & mask).sum(), (value_eq & mask).sum()])
        key = (layer, site)
        self._pending[key] = counts if key not in self._pending else self._pending[key] + counts

    @property
    def agreement(self) -> dict[tuple[int, str], SiteAgreement]:
        """Audit counts per (layer, site), filled during the forward when an audit record is given (the device's
        counts are read here, once, not at every site of every forward)."""
        if self._pending:
            keys, pending = list(self._pending), self._pending
            self._pending = {}
            for key, (n, code, value) in zip(keys, torch.stack([pending[k] for k in keys]).tolist(), strict=True):
                stats = self._agreement.setdefault(key, SiteAgreement())
                stats.elements, stats.code_equal, stats.value_equal = (stats.elements + n, stats.code_equal + code,
                                                                       stats.value_equal + value)
        return self._agreement

    def release(self) -> None:
        """Drop the batch tensors the forward read (the audit record, the real-token mask): once the backward has run
        only the audit counts are read, and a step keeps each micro-batch's hook until it ends."""
        self.audit_record = None
        self.valid_mask = None

    def absorb(self, other: _FP4TrainHook) -> None:
        """Add another hook's audit counts to this one's: the micro-batches of one step audit as one batch."""
        for key, s in other.agreement.items():
            mine = self.agreement.setdefault(key, SiteAgreement())
            mine.elements, mine.code_equal, mine.value_equal = (mine.elements + s.elements,
                                                                mine.code_equal + s.code_equal,
                                                                mine.value_equal + s.value_equal)

    def layer_agreement(self) -> dict[int, float]:
        """Code agreement per layer over all its audited elements (input of rank_layers_by_mismatch)."""
        totals: dict[int, SiteAgreement] = {}
        for (layer, _), s in self.agreement.items():
            t = totals.setdefault(layer, SiteAgreement())
            t.elements, t.code_equal, t.value_equal = (t.elements + s.elements, t.code_equal + s.code_equal,
                                                       t.value_equal + s.value_equal)
        return {layer: t.code_agreement for layer, t in sorted(totals.items())}

    def metrics(self) -> dict[str, float]:
        """``quant/{code,value}_agreement`` overall and per ``layer{l}/{site}``; empty without an audit."""
        if not self.agreement:
            return {}
        out: dict[str, float] = {}
        total = SiteAgreement()
        for (layer, site), s in sorted(self.agreement.items()):
            out[f"quant/code_agreement/layer{layer}/{site}"] = s.code_agreement
            out[f"quant/value_agreement/layer{layer}/{site}"] = s.value_agreement
            total.elements += s.elements
            total.code_equal += s.code_equal
            total.value_equal += s.value_equal
        out["quant/code_agreement"] = total.code_agreement
        out["quant/value_agreement"] = total.value_agreement
        return out


class FakeQuantHook(_FP4TrainHook):
    """Plain RNE fake-quant with training's own scales at every site and weight (the ``fp4_qat`` baseline)."""

    def __init__(self, fmt: FP4Format | str, *, audit: BatchRecord | None = None,
                 valid_mask: Tensor | None = None, weights: FakeQuantCache | None = None) -> None:
        super().__init__(fmt, audit, valid_mask, weights)

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        self.check_finite(x, layer, site)
        out = fake_quantize(x, self.fmt)
        self._audit(x.detach(), out.detach(), layer, site)
        return out


class GuidedHook(_FP4TrainHook):
    """Rounds recorded sites to the rollout's codes (full) or to codes of the rollout's parity (parity).

    batch_record: the collated records of the minibatch, (B, T) like the training input. mode: "full" or
    "parity" (default: the record's). valid_mask: (B, T) real-token mask of the training input. audit: a
    full BatchRecord to audit against, or True to audit against batch_record itself (full records only).
    all_recorded: whether every position has a record (valid, and a real token where valid_mask says), if the
    caller knows it; None: read at the first guided site, a host sync that drains the device's queue mid-forward.
    """

    def __init__(self, fmt: FP4Format | str, batch_record: BatchRecord, mode: str | None = None,
                 valid_mask: Tensor | None = None, *, audit: bool | BatchRecord = False,
                 weights: FakeQuantCache | None = None, all_recorded: bool | None = None) -> None:
        self.mode = check_guidance_mode(mode or batch_record.mode)
        if self.mode == "full" and batch_record.mode == "parity":
            raise ValueError("guidance mode 'full' needs full records, the batch record holds parity bits only")
        if audit is True and batch_record.mode != "full":
            raise ValueError("audit=True needs a full batch record; pass the full audit BatchRecord instead")
        super().__init__(fmt, batch_record if audit is True else audit or None, valid_mask, weights)
        if batch_record.fmt != self.fmt:
            raise ValueError(f"batch record is {format_name(batch_record.fmt)}, training uses {format_name(self.fmt)}")
        if valid_mask is not None and tuple(valid_mask.shape) != tuple(batch_record.valid.shape):
            raise ValueError(f"valid_mask of shape {tuple(valid_mask.shape)} does not match the record's "
                             f"(B, T) = {tuple(batch_record.valid.shape)}")
        self.record: BatchRecord | None = batch_record
        self._recorded: Tensor | None = None
        """(B, T) positions whose record is used, recorded and real tokens (the same for every site: made once)."""
        self._all_valid = all_recorded
        """Whether every position has a record (the same for every site): the caller's all_recorded, else read once,
        one host sync a forward."""

    def release(self) -> None:
        """Also the micro-batch's record, its device copy and the codes unpacked from it (from the shapes, about
        0.24 GB a micro-batch of 2 at medium-moe x 1K tokens with parity records of every layer: ~31 GB that the 128
        micro-batches of a long-fit step held on the GPU until the step ended)."""
        super().release()
        self.record = None
        self._recorded = None

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        self.check_finite(x, layer, site)
        if self.record is None:
            raise RuntimeError("GuidedHook.activation after release(): a hook guides one forward")
        self.record = self.record.to(x.device)
        if not self.record.has(layer, site):
            out = fake_quantize(x, self.fmt)
        else:
            _check_leading(x, self.record.valid, layer, site)
            if self._recorded is None:
                self._recorded = self._mask(self.record, x, layer, site).contiguous()
            if self._all_valid is None:
                self._all_valid = bool(self._recorded.all())
            valid = self._recorded
            out = self._guided_in_place(x, valid, layer, site)
            if out is None:
                ref = self.record.ref(layer, site)
                if not self._all_valid:  # plain rounding where nothing was recorded, in the same guided pass
                    ref = with_own_rounding(ref, x.detach(), _expand_mask(valid, x)[..., 0], self.fmt)
                out = fake_quantize(x, self.fmt, ref, self.mode)
        self._audit(x.detach(), out.detach(), layer, site)
        return out

    def _guided_in_place(self, x: Tensor, valid: Tensor, layer: int, site: str) -> Tensor | None:
        """Where the fused kernels run (a GPU) and the record is NVFP4: one kernel reads the site where it lies in
        the batch record, where the ref path launches a dozen small kernels first (the site's views copied out, the
        parity bits unpacked, x's own quantization and the selects at padded positions). None elsewhere."""
        record = self.record
        assert record is not None
        if not fake_module._fused_wanted(x):
            return None
        from trace_lightning.kernels.fake_quant import record_guided_fake_quantized, takes  # Triton: where it runs

        if not takes(x, self.fmt):
            return None
        slot = record.layout.slot((layer, site))
        scales_at = slot.offset + slot.global_bytes
        value, inside = record_guided_fake_quantized(
            x.detach(), record.data, (slot.offset, scales_at, scales_at + slot.scale_bytes), slot.global_bytes > 0,
            record.mode, self.mode, None if self._all_valid else valid)
        return straight_through(x, value, inside)
