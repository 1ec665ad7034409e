"""Stored records: a faithful round trip, and every kind of bad record refused with RecordError."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from trace_lightning.guidance import QuantRecord, RecordError, RecordExchange, load_record, save_record
from trace_lightning.guidance.store import payload_checksum, record_tensors, serialized_payload_bytes
from trace_lightning.quant import FP4Format


def _record(t: int = 6, mode: str = "parity", version: int = 4, fmt: str = "nvfp4") -> QuantRecord:
    g = torch.Generator().manual_seed(t)
    f = FP4Format("nvfp4") if fmt == "nvfp4" else FP4Format("mxfp4")
    caps = {(2, "attn_in"): f.quantize(torch.randn(t, 64, generator=g)),
            (3, "v"): f.quantize(torch.randn(t, 2, 32, generator=g))}
    return QuantRecord.from_captures(caps, torch.randint(0, 300, (4, t, 2), generator=g), version, mode=mode)


def _assert_same(a: QuantRecord, b: QuantRecord) -> None:
    assert (a.mode, a.fmt, a.policy_version, a.length) == (b.mode, b.fmt, b.policy_version, b.length)
    assert a.tensors().keys() == b.tensors().keys()
    for name, t in a.tensors().items():
        assert t.dtype == b.tensors()[name].dtype
        torch.testing.assert_close(t, b.tensors()[name], rtol=0, atol=0)


def _resigned(record: QuantRecord, edit) -> bytes:
    """Serialize after `edit(tensors, metadata)`, with a valid checksum: only the validation can catch it."""
    tensors, metadata = record_tensors(record)
    edit(tensors, metadata)
    metadata["checksum"] = payload_checksum(tensors, metadata)
    return safetensors.torch.save(tensors, metadata=metadata)


@pytest.mark.parametrize("mode", ["full", "parity"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_roundtrip_bytes_and_file(tmp_path: Path, mode: str, fmt: str) -> None:
    rec = _record(mode=mode, fmt=fmt)
    assert rec.routes.dtype == torch.int16  # 300 experts do not fit a byte
    data = save_record(rec, tmp_path / "r.safetensors")
    assert (tmp_path / "r.safetensors").read_bytes() == data
    _assert_same(load_record(data, expected_version=4, fmt=fmt, mode=mode), rec)
    _assert_same(load_record(tmp_path / "r.safetensors"), rec)
    assert serialized_payload_bytes(data) == rec.bytes_per_token() * rec.length


@pytest.mark.parametrize("cut", [1, 7, 100, 300])
def test_truncated_record_is_refused(cut: int) -> None:
    data = save_record(_record())
    with pytest.raises(RecordError, match="truncated or unreadable"):
        load_record(data[: len(data) - cut])


def test_tampered_payload_or_metadata_is_refused() -> None:
    data = bytearray(save_record(_record()))
    data[-1] ^= 0x01  # one bit of the last tensor
    with pytest.raises(RecordError, match="checksum mismatch"):
        load_record(bytes(data))
    text = save_record(_record(version=4))
    forged = text.replace(b'"policy_version":"4"', b'"policy_version":"9"')
    assert forged != text
    with pytest.raises(RecordError, match="checksum mismatch"):
        load_record(forged, expected_version=9)


def test_misshaped_record_is_refused() -> None:
    rec = _record()

    def drop_a_block(tensors, metadata):
        tensors["2.attn_in.scales"] = tensors["2.attn_in.scales"][:, :-1].contiguous()

    def short_payload(tensors, metadata):
        tensors["3.v.payload"] = tensors["3.v.payload"][:-1].contiguous()

    def no_global(tensors, metadata):
        del tensors["3.v.global_scale"]

    def wrong_length(tensors, metadata):
        metadata["length"] = "7"

    def extra(tensors, metadata):
        tensors["evil"] = torch.zeros(3)

    for edit, message in ((drop_a_block, "block scales of shape"), (short_payload, "does not start with length"),
                          (no_global, "needs row global scales"), (wrong_length, "metadata says 7"),
                          (extra, "unexpected tensors")):
        with pytest.raises(RecordError, match=f"mis-shaped record: .*{message}"):
            load_record(_resigned(rec, edit))


def test_stale_record_is_refused() -> None:
    data = save_record(_record(version=4))
    assert load_record(data, expected_version=4).policy_version == 4
    with pytest.raises(RecordError, match="stale record: policy version 4 is older than the expected 5"):
        load_record(data, expected_version=5)


def test_wrong_format_is_refused() -> None:
    data = save_record(_record(mode="parity", fmt="nvfp4"))
    with pytest.raises(RecordError, match="wrong format: record is nvfp4, expected mxfp4:floor"):
        load_record(data, fmt="mxfp4")
    with pytest.raises(RecordError, match="wrong format: record mode is 'parity', expected 'full'"):
        load_record(data, mode="full")
    plain = safetensors.torch.save({"x": torch.zeros(2)})
    with pytest.raises(RecordError, match="wrong format: not a trace_lightning.record/2 record"):
        load_record(plain)

    def float_scales(tensors, metadata):
        tensors["2.attn_in.scales"] = tensors["2.attn_in.scales"].float()

    def unknown_kind(tensors, metadata):
        metadata["format"] = "int4"

    with pytest.raises(RecordError, match="scales has dtype torch.float32, expected torch.uint8"):
        load_record(_resigned(_record(), float_scales))
    with pytest.raises(RecordError, match="wrong format: unknown FP4 format 'int4'"):
        load_record(_resigned(_record(), unknown_kind))


def test_missing_file_is_a_record_error(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="cannot read record"):
        load_record(tmp_path / "absent.safetensors")
    assert issubclass(RecordError, ValueError)


def test_exchange_moves_records_as_bytes_and_counts_them() -> None:
    ex = RecordExchange()
    batch = [_record(5), _record(8)]
    ticket = ex.send(batch)
    assert ex.pending == 1
    received = ex.receive(ticket, expected_version=4, mode="parity")
    for a, b in zip(received, batch, strict=True):
        _assert_same(a, b)
    m = ex.metrics()
    assert m["guidance/bytes_per_token"] == sum(r.payload_bytes() for r in batch) / 13
    assert m["guidance/exchange_bytes"] == sum(len(save_record(r)) for r in batch)
    assert m["guidance/exchange_ms"] > 0 and ex.pending == 0
    with pytest.raises(KeyError, match="no pending records for ticket 0"):
        ex.receive(ticket)
    stale = ex.send([_record(5, version=2), _record(6, version=4)])
    with pytest.raises(RecordError, match="stale record"):
        ex.receive(stale, expected_version=3)
    ex.reset_metrics()
    assert ex.metrics() == {"guidance/bytes_per_token": 0.0, "guidance/exchange_bytes": 0.0,
                            "guidance/exchange_ms": 0.0}
