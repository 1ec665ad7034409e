"""The packed batch record: one uint8 row per token that round-trips every site bit for bit, compacts on its
device exactly like the per-sequence records did, and is checked in place as strictly as a loaded record."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from trace_lightning.guidance import BatchRecord, ModelIdentity, QuantRecord, collate_records
from trace_lightning.guidance.layout import RecordLayout
from trace_lightning.quant import FP4Format, parse_format
from trace_lightning.sim import write_record_slot


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4:none", "mxfp4:floor", "mxfp4:rceil"])
def test_layout_round_trips_each_site_and_keeps_slots_aligned(fmt: str) -> None:
    fp4 = parse_format(fmt)
    shapes = {(0, "attn_in"): ((), 64), (0, "k"): ((2,), 32), (3, "moe_down"): ((3,), 96)}
    layout = RecordLayout.build(fp4, "full", shapes)
    assert layout.width % 16 == 0 and all(s.offset % 4 == 0 for s in layout.slots)
    assert layout.width >= layout.payload_bytes_per_token == sum(s.size for s in layout.slots)
    g = torch.Generator().manual_seed(1)
    data = torch.zeros(2, 7, layout.width, dtype=torch.uint8)
    originals = {}
    for key, (rows, k) in shapes.items():
        q = fp4.quantize(torch.randn(2, 7, *rows, k, generator=g) * 3)
        g_rows = q.global_scale.reshape(14, -1) if getattr(q, "global_scale", None) is not None else None
        write_record_slot(data, torch.arange(14), q.packed.reshape(14, -1), q.scale_bytes().reshape(14, -1), g_rows,
                          layout.slot(key).offset, parity=False)
        originals[key] = q
    for key, q in originals.items():
        back = layout.blocks(data, key)
        assert torch.equal(back.packed, q.packed) and torch.equal(back.scale_bytes(), q.scale_bytes())
        if getattr(q, "global_scale", None) is not None:
            assert torch.equal(back.global_scale, q.global_scale.float())
        assert torch.equal(back.dequantize(torch.float32), q.dequantize(torch.float32))


def test_layout_refuses_shapes_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        RecordLayout.build(FP4Format(), "full", {(0, "attn_in"): ((), 40)})
    with pytest.raises(ValueError, match="'full' or 'parity'"):
        RecordLayout.build(FP4Format(), "codes", {(0, "attn_in"): ((), 64)})
    layout = RecordLayout.build(FP4Format(), "parity", {(0, "attn_in"): ((), 64)})
    with pytest.raises(ValueError, match="cannot be expanded"):
        layout.select(mode="full")
    with pytest.raises(ValueError, match="not recorded"):
        layout.select([(1, "attn_in")])


@pytest.fixture(scope="module")
def records(debug_model: object, make_records: Callable[..., list[QuantRecord]]) -> list[QuantRecord]:
    return make_records(debug_model, [[1, 5, 9, 2, 7], [3, 4], [8, 8, 1, 2, 3, 4, 5, 6]], mode="full")


def test_packed_batch_matches_the_per_sequence_records(records: list[QuantRecord]) -> None:
    batch = collate_records(records, pad_to=9)
    assert batch.data.dim() == 3 and batch.data.is_contiguous() and batch.data.dtype == torch.uint8
    for i, rec in enumerate(records):
        n = rec.length
        assert batch.valid[i].tolist() == [True] * n + [False] * (9 - n)
        for layer, site in rec.sites:
            ref, ours = rec.ref(layer, site), batch.ref(layer, site)
            assert torch.equal(ours.packed[i, :n], ref.packed) and torch.equal(ours.scale_bytes()[i, :n],
                                                                               ref.scale_bytes())
            pad = ours.dequantize(torch.float32)[i, n:]
            assert bool((pad == 0).all())  # +0 codes under unit scales: finite zeros at padded positions
        again = batch.sequence(i)
        assert again.tensors().keys() == rec.tensors().keys()
        assert all(torch.equal(a, b) for a, b in zip(again.tensors().values(), rec.tensors().values(), strict=True))


def test_device_compaction_equals_compacting_each_record(records: list[QuantRecord]) -> None:
    full = collate_records(records, pad_to=8)
    layers = [1]
    ours = full.compact("parity", layers=layers)
    theirs = collate_records([r.compact("parity", layers) for r in records], pad_to=8)
    assert ours.layout == theirs.layout and torch.equal(ours.data, theirs.data)
    assert torch.equal(ours.routes, theirs.routes) and torch.equal(ours.valid, theirs.valid)
    assert full.compact() is full  # nothing to drop: the same record, no copy
    window = full.window(5)
    assert window.length == 5 and torch.equal(window.ref(1, "k").packed, full.ref(1, "k").packed[:, :5])


def _identity(records: list[QuantRecord], n_experts: int = 8) -> ModelIdentity:
    n_layers, _, top_k = records[0].routes.shape
    return ModelIdentity(records[0].model_id, n_layers, n_experts, top_k)


def test_in_place_check_accepts_a_good_batch_and_names_what_is_wrong(records: list[QuantRecord]) -> None:
    batch = collate_records(records)
    model = _identity(records)
    batch.check(expected_version=records[0].policy_version, model=model)
    with pytest.raises(ValueError, match="stale record"):
        batch.check(expected_version=records[0].policy_version + 1)
    with pytest.raises(ValueError, match="another model"):
        batch.check(model=ModelIdentity("f" * 64, model.n_layers, model.n_experts, model.top_k))
    with pytest.raises(ValueError, match="layers with top"):
        batch.check(model=ModelIdentity(model.fingerprint, model.n_layers + 1, model.n_experts, model.top_k))
    slot = batch.layout.slot((1, "moe_in"))
    bad = batch.data.clone()
    bad[0, 0, slot.offset + slot.global_bytes] = 0x7F  # an E4M3 NaN block scale
    with pytest.raises(ValueError, match="layer 1 site moe_in: 1 NaN, zero or negative E4M3"):
        BatchRecord(bad, batch.routes, batch.valid, batch.layout, batch.policy_versions).check()
    routes = batch.routes.clone()
    routes[0, 1, 0] = routes[0, 1, 0, 0]  # the same expert twice
    with pytest.raises(ValueError, match="duplicate expert ids"):
        BatchRecord(batch.data, routes, batch.valid, batch.layout, batch.policy_versions).check()
    with pytest.raises(ValueError, match="outside the model's 2 experts"):
        batch.check(model=ModelIdentity(model.fingerprint, model.n_layers, 2, model.top_k))
