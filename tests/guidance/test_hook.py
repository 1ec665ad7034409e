"""The training hooks on single sites: the guided-rounding property, fallbacks, errors, audit and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning.guidance import (
    BatchRecord,
    FakeQuantHook,
    FiniteCheckHook,
    GuidedHook,
    NonFiniteActivationError,
    QuantRecord,
    collate_records,
)
from trace_lightning.quant import BlockFP4, FP4Format, guided_quantize, parse_format

FORMATS = ["nvfp4", "nvfp4:none", "mxfp4:floor", "mxfp4:rceil"]


def _rollout(x: torch.Tensor, fmt: str, mode: str, version: int = 0) -> tuple[BlockFP4, BatchRecord]:
    """The rollout's FP4 of x (B, T, K) and the collated record of it, one sequence per batch row."""
    f = parse_format(fmt)
    q = f.quantize(x)
    records = []
    for b in range(x.shape[0]):
        rec = QuantRecord.from_captures({(0, "attn_in"): f.quantize(x[b])}, torch.zeros(1, x.shape[1], 1,
                                        dtype=torch.long), version, mode=mode)
        records.append(rec)
    return q, collate_records(records)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(FORMATS), log_scale=st.floats(-12, 12),
       reach=st.floats(0.0, 0.96))
def test_parity_hook_recovers_the_rollout_under_small_perturbations(seed: int, fmt: str, log_scale: float,
                                                                    reach: float) -> None:
    """DESIGN.md 5: |y - y_rollout| < 0.25 in E2M1 units (the rollout's scales) -> the rollout's code and value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 64, generator=g) * 2.0**log_scale
    x[0, 0, :16] = 0.0  # an all-zero block
    q, batch = _rollout(x, fmt, "parity")
    unit = q.block_multiplier().repeat_interleave(q.block_size, dim=-1)  # one E2M1 unit in x's units
    delta = (torch.rand(x.shape, generator=g) * 2 - 1) * 0.25 * reach
    out = GuidedHook(fmt, batch, "parity").activation(x + delta * unit, layer=0, site="attn_in")
    torch.testing.assert_close(out, q.dequantize(torch.float32), rtol=0, atol=0)


def test_parity_is_not_magic_beyond_the_bound() -> None:
    x = torch.full((1, 1, 16), 1.0)
    x[..., 0] = 6.0  # block max: E2M1 unit = 1 exactly (nvfp4:none, scale 1.0), y = x
    q, batch = _rollout(x, "nvfp4:none", "parity")
    hook = GuidedHook("nvfp4:none", batch, "parity")
    assert hook.activation(x + 0.24, layer=0, site="attn_in")[0, 0, 1] == 1.0
    assert hook.activation(x + 0.6, layer=0, site="attn_in")[0, 0, 1] == 2.0  # two grid steps: 1 -> 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_mode_uses_the_recorded_codes_and_plain_mode_its_own(fmt: str) -> None:
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(1))
    q, batch = _rollout(x, fmt, "full")
    far = x * 1.3  # training's own scales and codes would differ
    out = GuidedHook(fmt, batch, "full").activation(far, layer=0, site="attn_in")
    torch.testing.assert_close(out, q.dequantize(torch.float32), rtol=0, atol=0)
    plain = FakeQuantHook(fmt).activation(far, layer=0, site="attn_in")
    torch.testing.assert_close(plain, parse_format(fmt).quantize(far).dequantize(torch.float32), rtol=0, atol=0)
    other = GuidedHook(fmt, batch, "full").activation(far, layer=1, site="attn_in")  # no record there
    torch.testing.assert_close(other, plain, rtol=0, atol=0)


def test_padded_positions_fall_back_to_plain_fake_quant() -> None:
    g = torch.Generator().manual_seed(2)
    short = QuantRecord.from_captures({(0, "attn_in"): FP4Format().quantize(torch.randn(3, 64, generator=g))},
                                      torch.zeros(1, 3, 1, dtype=torch.long), 0, mode="parity")
    long = QuantRecord.from_captures({(0, "attn_in"): FP4Format().quantize(torch.randn(6, 64, generator=g))},
                                     torch.zeros(1, 6, 1, dtype=torch.long), 0, mode="parity")
    batch = collate_records([short, long], pad_to=6)
    tokens = torch.tensor([[True] * 3 + [False] * 3, [True] * 5 + [False]])  # training also masks long[5]
    x = torch.randn(2, 6, 64, generator=g) * 100
    out = GuidedHook("nvfp4", batch, "parity", tokens).activation(x, layer=0, site="attn_in")
    plain = FP4Format().quantize(x).dequantize()
    torch.testing.assert_close(out[0, 3:], plain[0, 3:], rtol=0, atol=0)
    torch.testing.assert_close(out[1, 5:], plain[1, 5:], rtol=0, atol=0)
    guided = guided_quantize(x[1], long.ref(0, "attn_in"), "parity").dequantize()  # the rollout's scales
    torch.testing.assert_close(out[1, :5], guided[:5], rtol=0, atol=0)
    assert not torch.equal(out[1, :5], plain[1, :5])
    assert bool(torch.isfinite(out).all())


def test_the_trainers_all_recorded_hint_rounds_as_the_hook_reading_the_mask_itself() -> None:
    """PolicyModule.recorded_rows reads, once a step, which sequences are real tokens with records at every
    position; a micro-batch of such rows passes all_recorded=True to its hook instead of the hook syncing on it
    mid-forward. The hint must be right: claimed for a padded row, it rounds the padding to the record's pad row."""
    from types import SimpleNamespace

    from trace_lightning.lit.policy import PolicyModule

    g = torch.Generator().manual_seed(3)

    def record(n: int) -> QuantRecord:
        return QuantRecord.from_captures({(0, "attn_in"): FP4Format().quantize(torch.randn(n, 64, generator=g))},
                                         torch.zeros(1, n, 1, dtype=torch.long), 0, mode="parity")

    batch = collate_records([record(3), record(6), record(6)], pad_to=6)
    real = torch.tensor([[True] * 3 + [False] * 4, [True] * 7, [True] * 7])  # (B, T + 1): the window is [:, :-1]
    rows = PolicyModule.recorded_rows(SimpleNamespace(attention_mask=real, record=batch))
    assert rows == [False, True, True]
    x = torch.randn(3, 6, 64, generator=g) * 100
    for part, hint in ((slice(1, 3), True), (slice(0, 1), False)):
        def out(all_recorded: bool | None, part: slice = part) -> torch.Tensor:
            hook = GuidedHook("nvfp4", batch.rows(part), "parity", real[part, :-1], all_recorded=all_recorded)
            return hook.activation(x[part], layer=0, site="attn_in")

        torch.testing.assert_close(out(hint), out(None), rtol=0, atol=0)
    assert not torch.equal(out(True, slice(0, 1)), out(None, slice(0, 1)))


def test_gradient_is_straight_through_and_finite_at_padding() -> None:
    x0 = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(3))
    batch = collate_records([QuantRecord.from_captures({(0, "attn_in"): FP4Format().quantize(x0[0, :2])},
                                                       torch.zeros(1, 2, 1, dtype=torch.long), 0, mode="parity")],
                            pad_to=4)
    x = x0.clone().requires_grad_(True)
    GuidedHook("nvfp4", batch).activation(x, layer=0, site="attn_in").sum().backward()
    assert bool(torch.isfinite(x.grad).all()) and set(x.grad.unique().tolist()) <= {0.0, 1.0}
    # Identity inside the E2M1 range, blocked where a value scaled past 6 (E4M3 scales can round down); the
    # recorded rows use the rollout's scales, the padded rows training's own.
    own = FP4Format().quantize(x0)
    y = own.scale_input(x0.reshape(1, 4, 4, 16)).reshape(x0.shape)
    y[:, :2] = batch.ref(0, "attn_in").scale_input(x0.reshape(1, 4, 4, 16)).reshape(x0.shape)[:, :2]
    torch.testing.assert_close(x.grad, (y.abs() <= 6).float(), rtol=0, atol=0)
    assert 0 < int((x.grad == 0).sum()) < 20


@pytest.mark.parametrize("hook", [lambda b: GuidedHook("nvfp4", b, "parity"), lambda b: FakeQuantHook("nvfp4")])
def test_non_finite_activation_names_layer_and_site(hook) -> None:
    x = torch.randn(1, 3, 64)
    _, batch = _rollout(x, "nvfp4", "parity")
    bad = x.clone()
    bad[0, 1, 5] = float("nan")
    with pytest.raises(NonFiniteActivationError, match="layer 0, site attn_in") as err:
        hook(batch).activation(bad, layer=0, site="attn_in")
    assert (err.value.layer, err.value.site) == (0, "attn_in")
    bad[0, 1, 5] = float("inf")
    with pytest.raises(NonFiniteActivationError, match="layer 0, site attn_in"):
        hook(batch).activation(bad, layer=0, site="attn_in")


def test_hook_refuses_mismatched_records() -> None:
    x = torch.randn(1, 3, 64)
    _, parity = _rollout(x, "nvfp4", "parity")
    _, full = _rollout(x, "nvfp4", "full")
    with pytest.raises(ValueError, match="'full' needs full records"):
        GuidedHook("nvfp4", parity, "full")
    with pytest.raises(ValueError, match="batch record is nvfp4, training uses mxfp4:floor"):
        GuidedHook("mxfp4", full)
    with pytest.raises(ValueError, match="audit=True needs a full batch record"):
        GuidedHook("nvfp4", parity, audit=True)
    with pytest.raises(ValueError, match="needs a full record"):
        GuidedHook("nvfp4", parity, audit=parity)
    with pytest.raises(ValueError, match=r"valid_mask of shape \(2, 3\)"):
        GuidedHook("nvfp4", full, valid_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"does not match the record's \(B, T\) = \(1, 3\)"):
        GuidedHook("nvfp4", full).activation(torch.randn(1, 4, 64), layer=0, site="attn_in")


def test_audit_counts_zero_codes_equal_and_nan_never() -> None:
    x = torch.zeros(1, 1, 16)
    x[..., 0] = 6.0
    x[..., 1] = -0.1  # rollout code 8 (-0)
    _, full = _rollout(x, "nvfp4:none", "full")
    y = x.clone()
    y[..., 1] = 0.1  # training code 0 (+0): equal codes and values
    y[..., 2] = 1.0  # one real mismatch: 0 vs 1
    hook = FakeQuantHook("nvfp4:none", audit=full)
    hook.activation(y, layer=0, site="attn_in")
    s = hook.agreement[(0, "attn_in")]
    assert (s.elements, s.code_equal, s.value_equal) == (16, 15, 15)
    m = hook.metrics()
    assert m["quant/code_agreement"] == m["quant/code_agreement/layer0/attn_in"] == 15 / 16
    assert hook.layer_agreement() == {0: 15 / 16}
    nan_ref = FakeQuantHook("nvfp4:none", audit=full)
    nan_ref._audit(y, torch.full_like(y, float("nan")), 0, "attn_in")
    assert nan_ref.agreement[(0, "attn_in")].value_equal == 0
    assert FakeQuantHook("nvfp4").metrics() == {}


@pytest.mark.parametrize("hook", [lambda b: GuidedHook("nvfp4", b, "parity"), lambda b: FakeQuantHook("nvfp4"),
                                  lambda b: FiniteCheckHook()], ids=["guided", "qat", "identity"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_deferred_finite_checks_name_the_first_bad_site_after_the_forward(hook, value: float) -> None:
    """Deferred: the forward runs on (no host sync a site), and one read afterwards names the first bad site; a
    site with no elements is never bad."""
    x = torch.randn(1, 3, 64)
    _, batch = _rollout(x, "nvfp4", "parity")
    h = hook(batch)
    h.deferred = True
    bad = x.clone()
    bad[0, 2, 7] = value
    h.activation(x, layer=0, site="attn_in")
    if type(h) is FiniteCheckHook:  # an empty site (the guided and fake-quant hooks need a record of its shape)
        h.activation(x[:, :0], layer=0, site="moe_down")
    h.activation(bad, layer=1, site="moe_in")  # no raise yet
    h.activation(bad, layer=2, site="attn_in")
    with pytest.raises(NonFiniteActivationError, match="layer 1, site moe_in"):
        h.raise_if_nonfinite()
    h.raise_if_nonfinite()  # the flags were read: nothing left to raise


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["full", "parity"])
def test_one_guided_pass_equals_guided_then_plain_where_unrecorded(fmt: str, mode: str) -> None:
    """Unrecorded positions are rounded in the guided pass itself, to x's own codes: the values and the gradient are
    those of the guided rounding where recorded and the plain rounding elsewhere, selected afterwards."""
    from trace_lightning.quant import fake_quantize

    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(2, 6, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    _, batch = _rollout(x0 * (1 + 0.05 * torch.randn(x0.shape, generator=g)), fmt, mode)
    tokens = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    x = x0.clone().requires_grad_(True)
    out = GuidedHook(fmt, batch, mode, tokens).activation(x, layer=0, site="attn_in")
    (out * torch.arange(64)).sum().backward()
    y = x0.clone().requires_grad_(True)
    want = torch.where(tokens[..., None], fake_quantize(y, fmt, batch.ref(0, "attn_in"), mode), fake_quantize(y, fmt))
    (want * torch.arange(64)).sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    assert not torch.equal(out[0, 4:], fake_quantize(x0, fmt, batch.ref(0, "attn_in"), mode)[0, 4:])
