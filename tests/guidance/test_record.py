"""QuantRecord: what full and parity records keep, bytes per token, compaction and collation."""

from __future__ import annotations

import pytest
import torch

from trace_lightning.guidance import QuantRecord, collate_records, layer_bytes_per_token, route_bytes_per_token
from trace_lightning.guidance.record import pack_bits, unpack_bits
from trace_lightning.guidance.store import save_record, serialized_payload_bytes
from trace_lightning.quant import FP4Format, quantize_mxfp4, quantize_nvfp4, row_global_scale

LENGTHS = [6, 10]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def _captures(t: int, fmt: str = "nvfp4", seed: int = 0) -> tuple[dict, torch.Tensor]:
    f = FP4Format("nvfp4") if fmt == "nvfp4" else FP4Format("mxfp4", mx_mode="rceil")
    caps = {(0, "attn_in"): f.quantize(_x(t, 64, seed=seed)), (1, "k"): f.quantize(_x(t, 2, 32, seed=seed + 1)),
            (1, "moe_down"): f.quantize(_x(t, 2, 64, seed=seed + 2))}
    # two distinct experts of 8 per token, as a router's top-k picks them
    routes = torch.rand(2, t, 8, generator=torch.Generator().manual_seed(seed)).argsort(dim=-1)[..., :2]
    return caps, routes


def test_pack_bits_roundtrip_and_layout() -> None:
    bits = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    packed = pack_bits(bits)
    assert packed.tolist() == [[0b10000001, 0b00000010]]
    torch.testing.assert_close(unpack_bits(packed), bits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.zeros(3, 12, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_full_and_parity_refs_hold_the_rollouts_scales_and_bits(fmt: str) -> None:
    caps, routes = _captures(7, fmt)
    full = QuantRecord.from_captures(caps, routes, 5, mode="full")
    parity = QuantRecord.from_captures(caps, routes, 5, mode="parity")
    assert full.length == parity.length == 7 and full.layers == [0, 1]
    assert full.routes.dtype == torch.uint8 and full.routes.tolist() == routes.tolist()
    for key, q in caps.items():
        f, p = full.ref(*key), parity.ref(*key)
        assert type(f) is type(q) is type(p) and f.shape == p.shape == q.shape
        torch.testing.assert_close(f.packed, q.packed, rtol=0, atol=0)
        torch.testing.assert_close(p.codes(), q.codes() & 1, rtol=0, atol=0)
        for r in (f, p):
            torch.testing.assert_close(r.scale_bytes(), q.scale_bytes(), rtol=0, atol=0)
            if fmt == "nvfp4":
                torch.testing.assert_close(r.global_scale, q.global_scale, rtol=0, atol=0)
    torch.testing.assert_close(full.ref(0, "attn_in").dequantize(), caps[(0, "attn_in")].dequantize(), rtol=0, atol=0)


def test_from_captures_keeps_requested_layers_only() -> None:
    caps, routes = _captures(5)
    rec = QuantRecord.from_captures(caps, routes, 0, mode="parity", layers=[1])
    assert sorted(rec.sites) == [(1, "k"), (1, "moe_down")] and rec.routes.shape == (2, 5, 2)
    with pytest.raises(ValueError, match=r"layers \[3\] were requested but not captured"):
        QuantRecord.from_captures(caps, routes, 0, layers=[1, 3])
    with pytest.raises(KeyError, match="no record for layer 0 site attn_in"):
        rec.ref(0, "attn_in")


def test_from_captures_rejects_inconsistent_inputs() -> None:
    caps, routes = _captures(5)
    with pytest.raises(ValueError, match="does not start with length"):
        QuantRecord.from_captures(caps, routes[:, :4], 0)
    mixed = {**caps, (0, "v"): quantize_mxfp4(_x(5, 64))}
    with pytest.raises(ValueError, match="mix formats"):
        QuantRecord.from_captures(mixed, routes, 0)
    x = _x(5, 64)
    scalar_g = {(0, "attn_in"): quantize_nvfp4(x, row_global_scale(x).amax())}
    with pytest.raises(ValueError, match="global scale must be per row"):
        QuantRecord.from_captures(scalar_g, routes, 0)
    with pytest.raises(ValueError, match="unknown guidance mode"):
        QuantRecord.from_captures(caps, routes, 0, mode="half")


def test_bytes_per_token_is_the_serialized_payload_per_token() -> None:
    caps, routes = _captures(9)
    for mode, expected in (("full", 32 + 4 + 4 + 2 * (16 + 2 + 4) + 2 * (32 + 4 + 4)),
                           ("parity", 8 + 4 + 4 + 2 * (4 + 2 + 4) + 2 * (8 + 4 + 4))):
        rec = QuantRecord.from_captures(caps, routes, 0, mode=mode)
        data = save_record(rec)
        assert serialized_payload_bytes(data) == rec.payload_bytes() == (expected + 4) * 9  # + 4 route bytes
        assert rec.bytes_per_token() == serialized_payload_bytes(data) / 9 == expected + 4


def test_debug_moe_bytes_per_token_full_vs_parity(debug_model, make_records, batch_of) -> None:
    seqs, _, _ = batch_of(LENGTHS)
    config = debug_model.config
    sizes = {}
    for mode in ("full", "parity"):
        rec = make_records(debug_model, seqs, mode=mode)[1]
        per_layer = layer_bytes_per_token(config, "nvfp4", mode)
        assert rec.bytes_per_token_by_layer() == per_layer
        assert rec.bytes_per_token() == sum(per_layer.values()) + route_bytes_per_token(config)
        assert serialized_payload_bytes(save_record(rec)) == rec.bytes_per_token() * rec.length
        sizes[mode] = rec.bytes_per_token()
    # Per layer: full 396 B (attn_in, attn_out, moe_in 76 each; k, v 44; moe_down 80), parity 156; routes 8.
    assert sizes == {"full": 4 * 396 + 8, "parity": 4 * 156 + 8}
    assert sizes["parity"] < 0.41 * sizes["full"]


def test_compact_to_parity_equals_a_parity_capture() -> None:
    caps, routes = _captures(6, "mxfp4")
    full = QuantRecord.from_captures(caps, routes, 2, mode="full")
    direct = QuantRecord.from_captures(caps, routes, 2, mode="parity", layers=[1])
    compacted = full.compact("parity", layers=[1])
    assert compacted.tensors().keys() == direct.tensors().keys()
    for name, t in compacted.tensors().items():
        torch.testing.assert_close(t, direct.tensors()[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot be expanded back"):
        direct.compact("full")


def test_collation_pads_safely_and_masks_padding() -> None:
    recs = [QuantRecord.from_captures(*_captures(t, seed=t), 1 + t, mode="parity") for t in (4, 7)]
    batch = collate_records(recs, pad_to=9)
    assert batch.valid.tolist() == [[True] * 4 + [False] * 5, [True] * 7 + [False] * 2]
    assert batch.policy_versions == [5, 8] and batch.mode == "parity"
    for key in recs[0].sites:
        ref = batch.ref(*key)
        assert ref.shape[:2] == (2, 9)
        values = ref.dequantize()
        assert bool(torch.isfinite(values).all())
        assert values[0, 4:].abs().sum() == 0 and values[1, 7:].abs().sum() == 0
        torch.testing.assert_close(ref.codes()[1, :7], recs[1].ref(*key).codes(), rtol=0, atol=0)
        torch.testing.assert_close(ref.scale_bytes()[0, :4], recs[0].ref(*key).scale_bytes(), rtol=0, atol=0)
    routes = batch.routes_for_replay()
    assert len(routes) == 2 and routes[0].shape == (2, 9, 2) and routes[0].dtype == torch.int64
    assert routes[1][0, :4].tolist() == recs[0].routes[1].tolist()
    assert routes[1][0, 4:].tolist() == [[0, 1]] * 5  # padded tokens route to distinct valid experts
    cut = collate_records(recs, pad_to=5)
    assert cut.valid.tolist() == [[True] * 4 + [False], [True] * 5] and cut.ref(1, "k").shape[:2] == (2, 5)
    assert collate_records(recs).length == 7


def test_collation_refuses_mixed_records() -> None:
    a = QuantRecord.from_captures(*_captures(4), 0, mode="parity")
    b = QuantRecord.from_captures(*_captures(4), 0, mode="full")
    with pytest.raises(ValueError, match="record 1 is full/nvfp4, record 0 is parity/nvfp4"):
        collate_records([a, b])
    with pytest.raises(ValueError, match="other sites"):
        collate_records([a, a.compact(layers=[1])])
    with pytest.raises(ValueError, match="at least one record"):
        collate_records([])
