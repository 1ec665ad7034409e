"""A training micro-step through the fused fake-quant kernels (as it runs on a GPU; here under Triton's interpreter)
gives the reference path's logits and every parameter gradient bit for bit: guided by parity records (trace_compact)
and plain (fp4_qat), weights through the step cache. The kernel that reads a site where it lies in the packed batch
record gives, site by site, what the reference ops give for that site's ref (with plain rounding where nothing was
recorded), with full and parity records, in both dtypes, NaN and inf blocks included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from trace_lightning.guidance import FakeQuantHook, GuidedHook, collate_records
from trace_lightning.kernels.fake_quant import record_guided_fake_quantized
from trace_lightning.model import QuantHook, Transformer
from trace_lightning.quant import FakeQuantCache, parse_format
from trace_lightning.quant import fake as fake_module
from trace_lightning.quant.fake import reference_fake_quantized, with_own_rounding

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter

LENGTHS = [9, 14, 11]


def _micro_step(model: Transformer, tokens: Tensor, mask: Tensor, hook: QuantHook, routed: Tensor | None,
                fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Tensor, dict[str, Tensor]]:
    calls = {"fused_fake_quantized": 0, "record_guided_fake_quantized": 0}
    import trace_lightning.kernels.fake_quant as kernel_module

    def counting(name: str):  # noqa: ANN202
        real = getattr(kernel_module, name)

        def count(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return real(*args, **kwargs)

        return count

    monkeypatch.setattr(fake_module, "_fused_wanted", lambda x: fused)
    for name in calls:
        monkeypatch.setattr(kernel_module, name, counting(name))
    sites = len(hook.record.layout.keys) if isinstance(hook, GuidedHook) else 0
    model.zero_grad(set_to_none=True)
    logits = model(tokens, attention_mask=mask, hook=hook, routed=routed)
    logits.float().log_softmax(-1)[mask].logsumexp(-1).mean().backward()
    assert (calls["fused_fake_quantized"] > 0) == fused
    assert calls["record_guided_fake_quantized"] == (sites if fused else 0)  # every guided site reads it in place
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["trace_compact", "fp4_qat"])
def test_fused_micro_step_equals_the_reference(debug_model, make_records, batch_of, method: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seqs, tokens, mask = batch_of(LENGTHS)
    guide = collate_records([r.compact("parity") for r in make_records(debug_model, seqs, "nvfp4")], tokens.shape[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run on CPU tensors only when interpreted
    model, guide = copy.deepcopy(debug_model).to(device), guide.to(device)
    tokens, mask = tokens.to(device), mask.to(device)
    results = []
    for fused in (False, True):
        weights = FakeQuantCache()
        hook = (GuidedHook("nvfp4", guide, "parity", mask, weights=weights) if method == "trace_compact"
                else FakeQuantHook("nvfp4", valid_mask=mask, weights=weights))
        routed = guide.routes_for_replay() if method == "trace_compact" else None
        results.append(_micro_step(model, tokens, mask, hook, routed, fused, monkeypatch))
    (ref_logits, ref_grads), (logits, grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def _site_input(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """Rows over many binades, a NaN block and an inf block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape[:-1], generator=g)).unsqueeze(-1)
    rows = x.view(-1, shape[-1])
    rows[-1, 3], rows[1, -1] = float("nan"), float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize(("fmt", "record_mode", "rounding", "dtype"), [
    ("nvfp4", "full", "full", torch.float32), ("nvfp4", "full", "parity", torch.bfloat16),
    ("nvfp4", "parity", "parity", torch.float32), ("nvfp4", "parity", "parity", torch.bfloat16),
    ("nvfp4:none", "parity", "parity", torch.float32)])
def test_in_place_record_kernel_equals_the_reference_site_by_site(debug_model, make_records, batch_of, fmt: str,
                                                                 record_mode: str, rounding: str,
                                                                 dtype: torch.dtype) -> None:
    seqs, tokens, _ = batch_of(LENGTHS)
    records = [r if record_mode == "full" else r.compact("parity") for r in make_records(debug_model, seqs, fmt)]
    # two positions past the longest record (pad rows), read through a window: a strided view of the bytes
    batch = collate_records(records, tokens.shape[1] + 3).window(tokens.shape[1] + 2)
    assert not batch.data.is_contiguous()
    recorded = batch.valid.clone()
    recorded[1, 2] = False  # a recorded position that training treats as padding (its valid mask)
    fmt = parse_format(fmt)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = batch.to(device)
    for i, key in enumerate(batch.layout.keys):
        slot = batch.layout.slot(key)
        x = _site_input((*batch.valid.shape, *slot.rows, slot.k), i, dtype)
        scales_at = slot.offset + slot.global_bytes
        offsets = (slot.offset, scales_at, scales_at + slot.scale_bytes)
        for mask in (recorded, None):
            value, inside = record_guided_fake_quantized(
                x.to(device), on_device.data, offsets, slot.global_bytes > 0, batch.mode, rounding,
                None if mask is None else mask.to(device))
            ref = batch.ref(*key)
            if mask is not None:
                ref = with_own_rounding(ref, x, mask.reshape(*mask.shape, *([1] * len(slot.rows))).expand(
                    x.shape[:-1]), fmt)
            want_value, want_inside = reference_fake_quantized(x, fmt, ref, rounding)
            value, nan = value.cpu(), want_value.isnan()
            assert torch.equal(value.isnan(), nan), (key, mask is None)
            assert torch.equal(value[~nan], want_value[~nan]), (key, mask is None)
            assert torch.equal(inside.cpu(), want_inside), (key, mask is None)
            assert nan.any() and not nan.all()


def test_in_place_record_kernel_refuses_what_it_cannot_read() -> None:
    data = torch.zeros(2, 3, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not match a uint8 record"):
        record_guided_fake_quantized(torch.zeros(2, 4, 16), data, (0, 0, 4), False, "full", "full")
    with pytest.raises(ValueError, match="needs full records"):
        record_guided_fake_quantized(torch.zeros(2, 3, 16), data, (0, 0, 4), False, "parity", "full")
    with pytest.raises(ValueError, match="multiple of 16"):
        record_guided_fake_quantized(torch.zeros(2, 3, 8), data, (0, 0, 4), False, "full", "full")


class _DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would each be a GPU launch (views and metadata ops launch nothing)."""

    FREE = ("view", "reshape", "_reshape_alias", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
            "detach", "alias", "t", "transpose", "permute", "empty", "empty_like", "empty_strided", "_to_copy_noop",
            "lift_fresh", "_unsafe_view", "split", "unbind")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's API)
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["trace_compact", "fp4_qat"])
def test_a_site_is_its_kernel_and_a_reduction(debug_model, make_records, batch_of, method: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fused path a site launches its one kernel and the deferred finite check's one reduction, whatever its
    shape and padding: guided (about twenty launches before the in-place kernel and the one-pass check) and plain
    (the quantizer and the guided kernel before the one-pass kernel); the recorded-position mask is made once a
    forward."""
    seqs, tokens, mask = batch_of(LENGTHS)
    guide = collate_records([r.compact("parity") for r in make_records(debug_model, seqs, "nvfp4")], tokens.shape[1])
    import trace_lightning.kernels.fake_quant as kernel_module

    kernel_calls: list[str] = []

    def stub(name: str):  # noqa: ANN202
        def launch(x: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:  # noqa: ANN002, ANN003
            kernel_calls.append(name)
            return torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool)

        return launch

    monkeypatch.setattr(fake_module, "_fused_wanted", lambda x: True)
    for name in ("record_guided_fake_quantized", "plain_fake_quantized"):
        monkeypatch.setattr(kernel_module, name, stub(name))
    hook = GuidedHook("nvfp4", guide, "parity", mask) if method == "trace_compact" else FakeQuantHook("nvfp4")
    hook.deferred = True
    per_site = []
    for i, (layer, site) in enumerate(guide.layout.keys):
        slot = guide.layout.slot((layer, site))
        x = torch.randn(*mask.shape, *slot.rows, slot.k)
        with _DeviceOps() as counted:
            hook.activation(x, layer=layer, site=site)
        per_site.append(counted.ops if i else [op for op in counted.ops if op not in ("bitwise_and", "all",
                                                                                      "_local_scalar_dense", "clone")])
    kernel = "record_guided_fake_quantized" if method == "trace_compact" else "plain_fake_quantized"
    assert kernel_calls == [kernel] * len(guide.layout.keys)
    assert all(ops == ["linalg_vector_norm"] for ops in per_site), per_site
