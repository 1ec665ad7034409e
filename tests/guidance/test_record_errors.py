"""Records that would change the loss silently are refused: bad scales, bad routes, empty, another model; and
load_record checks a file before reading it (a FIFO must not hang it, /dev/zero must not exhaust memory)."""

import copy
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from trace_lightning.guidance import ModelIdentity, QuantRecord, RecordError, load_record, save_record
from trace_lightning.guidance.record import SiteRecord, check_route_values
from trace_lightning.guidance.store import (
    MAX_RECORD_BYTES,
    payload_checksum,
    record_tensors,
    serialized_payload_bytes,
)
from trace_lightning.model import Transformer
from trace_lightning.quant import FP4Format
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def _record(fmt: str = "nvfp4", t: int = 5, model_id: str = "m") -> QuantRecord:
    f = FP4Format("nvfp4") if fmt == "nvfp4" else FP4Format("mxfp4", mx_mode="rceil")
    caps = {(0, "attn_in"): f.quantize(_x(t, 64)), (1, "k"): f.quantize(_x(t, 2, 32, seed=1))}
    routes = torch.rand(2, t, 8, generator=torch.Generator().manual_seed(0)).argsort(dim=-1)[..., :2]
    return QuantRecord.from_captures(caps, routes, 3, mode="full", model_id=model_id)


def _rebuilt(record: QuantRecord, edit: Callable[[dict[str, torch.Tensor]], None]) -> QuantRecord:
    tensors = {k: v.clone() for k, v in record.tensors().items()}
    edit(tensors)
    sites = {key: type(rec)(tensors[f"{key[0]}.{key[1]}.scales"], tensors[f"{key[0]}.{key[1]}.payload"],
                            tensors.get(f"{key[0]}.{key[1]}.global_scale")) for key, rec in record.sites.items()}
    return QuantRecord(sites, tensors["routes"], record.policy_version, record.mode, record.fmt, record.model_id)


def _set(name: str, index: tuple[int, ...], value: float | int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name][index] = value

    return edit


def test_the_unedited_record_is_valid() -> None:
    record = _record()
    assert _rebuilt(record, lambda t: None).tensors().keys() == record.tensors().keys()


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        ("nvfp4", _set("0.attn_in.scales", (2, 1), 0x7F), r"layer 0 site attn_in: 1 NaN, zero or negative E4M3 block"),
        ("nvfp4", _set("0.attn_in.scales", (0, 0), 0x00), r"layer 0 site attn_in: 1 NaN, zero or negative E4M3"),
        ("nvfp4", _set("1.k.scales", (4, 1, 0), 0xB8), r"layer 1 site k: 1 NaN, zero or negative .*\(4, 1, 0\)"),
        ("nvfp4", _set("0.attn_in.global_scale", (1, 0), math.nan), r"1 NaN, infinite, zero or negative row global"),
        ("nvfp4", _set("0.attn_in.global_scale", (1, 0), -math.inf), r"row global scale.*\(1, 0\) \(-inf\)"),
        ("nvfp4", _set("1.k.global_scale", (0, 0, 0), 0.0), r"layer 1 site k: 1 NaN, infinite, zero or negative row"),
        ("mxfp4", _set("0.attn_in.scales", (3, 0), 0xFF), r"layer 0 site attn_in: 1 NaN \(0xFF\) E8M0 block scale"),
    ],
    ids=["nan-e4m3", "zero-e4m3", "negative-e4m3", "nan-global", "-inf-global", "zero-global", "nan-e8m0"],
)
def test_impossible_scales_are_refused(fmt: str, edit, message: str) -> None:  # noqa: ANN001
    record = _record(fmt)
    with pytest.raises(ValueError, match=message):
        _rebuilt(record, edit)


def test_every_e4m3_scale_byte_is_judged_as_ml_dtypes_decodes_it() -> None:
    """The block-scale check reads bytes, not decoded floats: over all 256 E4M3 bytes it refuses exactly those that
    ml_dtypes decodes to NaN, zero or a negative value (rtol=0, atol=0: the masks are equal)."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    expected = ~(np.isfinite(values) & (values > 0))
    scales = torch.arange(256, dtype=torch.uint8).reshape(16, 16)[:, ::2]  # a strided view, as a record's site is
    rec = SiteRecord(scales, torch.zeros(16, 64, dtype=torch.uint8), None)
    block, bad_global = rec.bad_scales(FP4Format("nvfp4", global_scale="none"))
    assert bad_global is None
    np.testing.assert_array_equal(block.numpy(), expected.reshape(16, 16)[:, ::2])
    assert int(block.sum()) == int(expected.reshape(16, 16)[:, ::2].sum()) > 0


def test_duplicate_and_negative_expert_ids_are_refused() -> None:
    record = _record()
    with pytest.raises(ValueError, match=r"duplicate expert ids \[\d, \d\] at layer 1 position 3"):
        _rebuilt(record, lambda t: t["routes"][1, 3].copy_(t["routes"][1, 3, :1].expand(2)))
    wide = record.routes.to(torch.int16)
    wide[0, 2, 1] = -4
    with pytest.raises(ValueError, match=r"negative expert id -4"):
        QuantRecord(record.sites, wide, 3, "full", record.fmt, "m")


def test_an_empty_record_is_refused() -> None:
    with pytest.raises(ValueError, match=r"empty record: routes of shape \(2, 0, 2\)"):
        QuantRecord({}, torch.zeros(2, 0, 2, dtype=torch.uint8), 0, "full", FP4Format())
    with pytest.raises(ValueError, match=r"empty record"):
        QuantRecord({}, torch.zeros(0, 3, 2, dtype=torch.uint8), 0, "full", FP4Format())


IDENTITY = ModelIdentity("m", n_layers=2, n_experts=8, top_k=2)


@pytest.mark.parametrize(
    ("identity", "message"),
    [
        (ModelIdentity("other", 2, 8, 2), r"wrong model: record comes from another model or checkpoint"),
        (ModelIdentity("m", 3, 8, 2), r"record routes are for 2 layers with top-2, the model has 3 layers with top-2"),
        (ModelIdentity("m", 2, 8, 4), r"the model has 2 layers with top-4"),
        (ModelIdentity("m", 2, 6, 2), r"expert id [67] is outside the model's 6 experts"),
    ],
    ids=["fingerprint", "layers", "top_k", "expert-range"],
)
def test_a_record_of_another_model_is_refused_where_it_is_used(identity: ModelIdentity, message: str) -> None:
    data = save_record(_record())
    assert load_record(data, model=IDENTITY).model_id == "m"
    with pytest.raises(RecordError, match=message):
        load_record(data, model=identity)


def test_a_record_without_a_model_id_is_refused_by_a_consumer_that_expects_one() -> None:
    with pytest.raises(RecordError, match=r"fingerprint none, expected m"):
        load_record(save_record(_record(model_id="")), model=IDENTITY)


def _resigned(record: QuantRecord, edit: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
    """A record a buggy producer wrote with bad values and a valid checksum."""
    tensors, metadata = record_tensors(record)
    tensors = {k: v.clone() for k, v in tensors.items()}
    edit(tensors)
    metadata["checksum"] = payload_checksum(tensors, metadata)
    return safetensors.torch.save(tensors, metadata=metadata)


def test_load_record_checks_values_behind_a_valid_checksum() -> None:
    data = _resigned(_record(), _set("0.attn_in.scales", (1, 1), 0x7F))
    with pytest.raises(RecordError, match=r"layer 0 site attn_in: 1 NaN, zero or negative E4M3 block scale"):
        load_record(data)
    data = _resigned(_record(), lambda t: t["routes"][0, 0].fill_(5))
    with pytest.raises(RecordError, match=r"duplicate expert ids \[5, 5\] at layer 0 position 0"):
        load_record(data)


@pytest.fixture(scope="module")
def two_checkpoints() -> tuple[Transformer, Transformer]:
    """Two models of the same shape (another seed): their records must not be mixed."""
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(Transformer.from_name("debug-moe", n_layers=2, init_std=0.08).eval())
    return models[0], models[1]


def _engine_record(model: Transformer) -> tuple[Engine, QuantRecord]:
    engine = Engine(copy.deepcopy(model), FP4Precision(fmt="nvfp4"), backend="sim")
    out = engine.generate([[1, 5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0),
                          capture=CaptureSpec(layers={1}))
    record = QuantRecord.from_captures(out.captures[0], out.routes[0], out.policy_version, model_id=engine.model_id)
    return engine, record


def test_records_from_another_checkpoint_of_the_same_shape_are_refused(two_checkpoints: tuple) -> None:
    ours, theirs = two_checkpoints
    identity = ModelIdentity.of(ours.config, ours.state_dict())
    engine, record = _engine_record(ours)
    assert engine.model_id == identity.fingerprint  # the trainer and the rollout agree on the identity
    assert load_record(save_record(record), model=identity).length == record.length
    _, foreign = _engine_record(theirs)
    with pytest.raises(RecordError, match="record comes from another model or checkpoint"):
        load_record(save_record(foreign), model=identity)


def test_the_engine_identity_follows_weight_updates(two_checkpoints: tuple) -> None:
    ours, theirs = two_checkpoints
    engine, _ = _engine_record(theirs)
    assert engine.model_id != ModelIdentity.of(ours.config, ours.state_dict()).fingerprint
    engine.update_weights(ours.state_dict(), version=1)  # now it rolls out our weights: our identity
    assert engine.model_id == ModelIdentity.of(ours.config, ours.state_dict()).fingerprint
    engine.update_weights({"norm.weight": ours.norm.weight * 1.01}, version=2)
    assert engine.model_id != ModelIdentity.of(ours.config, ours.state_dict()).fingerprint


def _load_within(source: object, seconds: float = 10.0) -> BaseException:
    """Run load_record in a thread: a hang fails the test instead of freezing it."""
    result: list[BaseException] = []

    def run() -> None:
        try:
            load_record(source)
        except BaseException as err:  # noqa: BLE001 (the test inspects whatever came out)
            result.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"load_record({source}) did not return within {seconds} s"
    assert result, "load_record accepted a non-record"
    return result[0]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "record.safetensors"
    os.mkfifo(fifo)
    err = _load_within(fifo)
    assert isinstance(err, RecordError) and "not a regular file" in str(err)


def test_dev_zero_is_refused_without_reading() -> None:
    err = _load_within("/dev/zero")
    assert isinstance(err, RecordError) and "not a regular file" in str(err)


def _blob(header: dict, payload: bytes = b"", declared_len: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return (len(text) if declared_len is None else declared_len).to_bytes(8, "little") + text + payload


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (_blob({"routes": {"dtype": "U8", "shape": [10**12], "data_offsets": [0, 10**12]}}, b"\0" * 16),
         r"tensor 'routes' declares 1000000000000 bytes at 0\.\.1000000000000, the record holds 16"),
        (_blob({"routes": {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 2]}}, b"\0" * 4),
         r"tensor 'routes' declares 4 bytes at 0\.\.2"),
        (_blob({"routes": {"dtype": "U8", "shape": [-2, 2], "data_offsets": [0, 0]}}), r"tensor 'routes' declares"),
        (_blob({"routes": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), r"wrong format"),
        (_blob({}, declared_len=2**60), r"header of 1152921504606846976 bytes declared"),
        (b"\x01\x02", r"2 bytes, no safetensors header"),
    ],
    ids=["huge-tensor", "short-offsets", "negative-dim", "foreign-dtype", "huge-header", "tiny"],
)
def test_declared_sizes_are_checked_before_anything_is_allocated(tmp_path: Path, blob: bytes, message: str) -> None:
    path = tmp_path / "record.safetensors"
    path.write_bytes(blob)
    for source in (blob, path):
        with pytest.raises(RecordError, match=message):
            load_record(source)


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "record.safetensors"
    path.write_bytes(save_record(_record()))
    assert load_record(path).length == 5
    with pytest.raises(RecordError, match=r"exceeds the 100-byte limit"):
        load_record(path, max_bytes=100)


def test_route_checks_accept_what_a_router_produces() -> None:
    routes = torch.rand(3, 7, 16).argsort(dim=-1)[..., :4]
    check_route_values(routes, n_experts=16)
    with pytest.raises(ValueError, match="outside the model's 15 experts"):
        check_route_values(torch.tensor([[[14, 15]]]), n_experts=15)


def test_a_directory_is_refused_naming_its_path(tmp_path: Path) -> None:
    err = _load_within(tmp_path)
    assert isinstance(err, RecordError)
    assert str(err) == f"cannot read record {tmp_path}: it is a directory, not a record file"


class CountingReader:
    """A binary file that counts the bytes read through it."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.bytes_read = handle, 0

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.bytes_read += len(data)
        return data

    def __enter__(self) -> "CountingReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def test_a_large_file_is_refused_from_its_header_without_reading_its_body(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 GiB file (sparse, just under the size limit) starting with a valid record's header: the header is checked
    against the file's size before the body is read, so the refusal reads a few hundred bytes, not 4 GiB."""
    good = save_record(_record())
    n = int.from_bytes(good[:8], "little")
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.write(good[: 8 + n])
        f.truncate(MAX_RECORD_BYTES - 1)
    readers: list[CountingReader] = []
    real_fdopen = os.fdopen

    def counting_fdopen(fd: int, *args: object, **kwargs: object) -> CountingReader:
        readers.append(CountingReader(real_fdopen(fd, *args, **kwargs)))
        return readers[-1]

    monkeypatch.setattr(os, "fdopen", counting_fdopen)
    err = _load_within(path, seconds=2.0)
    assert isinstance(err, RecordError), err
    assert f"its tensors declare {serialized_payload_bytes(good)} bytes of data, the record holds " in str(err)
    assert [r.bytes_read for r in readers] == [8 + n]  # the length prefix and the header, nothing of the body


def test_a_record_with_bytes_past_its_tensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "record.safetensors"
    path.write_bytes(save_record(_record()) + b"\0" * 64)
    with pytest.raises(RecordError, match=r"its tensors declare \d+ bytes of data, the record holds \d+"):
        load_record(path)
