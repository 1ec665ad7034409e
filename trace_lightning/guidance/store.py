"""Records on the wire: safetensors with a checksum and the policy version, refused loudly when wrong.

A record that is truncated, modified, inconsistently shaped, in another format, from another model
(weights fingerprint, layer count, top-k, expert range) or from an older policy than the trainer expects
must never steer training, so `load_record` either returns a fully validated QuantRecord or raises
`RecordError` saying what is wrong. A file is checked (regular, size, header and declared tensor sizes)
before its body is read, so a FIFO, a directory or /dev/zero passed as a record fails at once, and a large
file that is not a record is refused from its first bytes. `RecordExchange` moves records from the
rollout side to the training side as bytes, so what is counted is what would cross a network.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
from safetensors import SafetensorError
from torch import Tensor

from trace_lightning.guidance.record import ModelIdentity, QuantRecord, SiteRecord, format_name
from trace_lightning.quant import FP4Format, parse_format

SCHEMA = "trace_lightning.record/2"
_META_KEYS = ("schema", "mode", "format", "policy_version", "length", "sites", "model_id")
MAX_RECORD_BYTES = 1 << 32
"""Largest record file load_record reads (a sequence's full record is megabytes at most)."""
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors JSON header (safetensors' own limit)."""
_DTYPE_BYTES = {"U8": 1, "I16": 2, "F32": 4}
"""The dtypes a record stores (uint8 scales and payloads, int16 routes, float32 global scales)."""
_SITE_TENSORS = ("scales", "payload", "global_scale")


class RecordError(ValueError):
    """A stored record is truncated, tampered with, mis-shaped, of the wrong format or model, or stale."""


def _tensor_bytes(t: Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def payload_checksum(tensors: dict[str, Tensor], metadata: dict[str, str]) -> str:
    """sha256 over the metadata (without the checksum) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in sorted(metadata.items()) if k != "checksum"}).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def record_tensors(record: QuantRecord) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and signed metadata a record serializes to."""
    tensors = {k: v.contiguous() for k, v in record.tensors().items()}
    metadata = {
        "schema": SCHEMA,
        "mode": record.mode,
        "format": format_name(record.fmt),
        "policy_version": str(record.policy_version),
        "length": str(record.length),
        "sites": json.dumps([[layer, site] for layer, site in record.sites]),
        "model_id": record.model_id,
    }
    metadata["checksum"] = payload_checksum(tensors, metadata)
    return tensors, metadata


def save_record(record: QuantRecord, path: str | Path | None = None) -> bytes:
    """Serialize to safetensors bytes (also written to `path` when given)."""
    tensors, metadata = record_tensors(record)
    data = safetensors.torch.save(tensors, metadata=metadata)
    if path is not None:
        Path(path).write_bytes(data)
    return data


def serialized_payload_bytes(data: bytes) -> int:
    """Bytes of tensor data in a safetensors blob: its size less the length prefix and the JSON header."""
    return len(data) - 8 - int.from_bytes(data[:8], "little")


def _read_file(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes, checked before its body is read: opening never blocks (a FIFO); a directory, a
    device (/dev/zero) or a file over max_bytes is refused unread; the header is read and checked against the
    file's size first, so a large file that is not a record costs a few bytes of reading, not its size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise RecordError(f"cannot read record {path}: {err.strerror}") from err
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise RecordError(f"cannot read record {path}: it is a directory, not a record file")
        if not stat.S_ISREG(info.st_mode):
            raise RecordError(f"cannot read record {path}: not a regular file")
        if info.st_size > max_bytes:
            raise RecordError(f"cannot read record {path}: {info.st_size} bytes exceeds the {max_bytes}-byte limit")
        with os.fdopen(os.dup(fd), "rb") as f:
            prefix = f.read(8)
            prefix += f.read(_header_length(prefix, info.st_size))
            _check_header(prefix, info.st_size)
            return prefix + f.read(info.st_size - len(prefix) + 1)
    except OSError as err:
        raise RecordError(f"cannot read record {path}: {err.strerror or err}") from err
    finally:
        os.close(fd)


def _header_length(prefix: bytes, size: int) -> int:
    """The JSON header's length from the first 8 bytes of a `size`-byte blob, refused unless it fits."""
    if size < 8 or len(prefix) < 8:
        raise RecordError(f"truncated record: {size} bytes, no safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise RecordError(f"truncated or unreadable record: header of {n} bytes declared, {size - 8} present")
    return n


def _check_header(prefix: bytes, size: int) -> dict[str, Any]:
    """The safetensors header of a `size`-byte blob starting with `prefix` (length + header), after checking that
    every tensor it declares lies in the bytes present and that together they cover them exactly."""
    n = _header_length(prefix, size)
    try:
        header = json.loads(prefix[8 : 8 + n])
    except ValueError as err:
        raise RecordError(f"unreadable record header: {err}") from err
    if not isinstance(header, dict):
        raise RecordError("unreadable record header: not a JSON object")
    payload, covered = size - 8 - n, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            size_of = _DTYPE_BYTES[entry["dtype"]] * math.prod(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise RecordError(f"wrong format: tensor {name!r} declares dtype/shape/offsets {entry!r}") from err
        if any(int(d) < 0 for d in entry["shape"]) or not 0 <= begin <= end <= payload or end - begin != size_of:
            raise RecordError(f"truncated or unreadable record: tensor {name!r} declares {size_of} bytes at "
                              f"{begin}..{end}, the record holds {payload}")
        covered = max(covered, end)
    if covered != payload:
        raise RecordError(f"unreadable record: its tensors declare {covered} bytes of data, the record holds "
                          f"{payload}")
    return header


def _read(source: bytes | str | Path,
          max_bytes: int = MAX_RECORD_BYTES) -> tuple[dict[str, Tensor], dict[str, str]]:
    data = bytes(source) if isinstance(source, bytes | bytearray) else _read_file(Path(source), max_bytes)
    if len(data) > max_bytes:
        raise RecordError(f"record of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    header = _check_header(data[: 8 + _header_length(data, len(data))], len(data))
    try:
        tensors = safetensors.torch.load(data)
    except (SafetensorError, ValueError) as err:
        raise RecordError(f"truncated or unreadable record ({len(data)} bytes): {err}") from err
    metadata = header.get("__metadata__") or {}
    if metadata.get("schema") != SCHEMA:
        raise RecordError(f"wrong format: not a {SCHEMA} record (schema {metadata.get('schema')!r})")
    missing = [k for k in (*_META_KEYS, "checksum") if k not in metadata]
    if missing:
        raise RecordError(f"wrong format: record metadata lacks {missing}")
    if payload_checksum(tensors, metadata) != metadata["checksum"]:
        raise RecordError("checksum mismatch: the record was modified or corrupted after it was saved")
    return tensors, metadata


def _build(tensors: dict[str, Tensor], metadata: dict[str, str]) -> QuantRecord:
    try:
        fmt = parse_format(metadata["format"])
        keys = [(int(layer), str(site)) for layer, site in json.loads(metadata["sites"])]
        version, length = int(metadata["policy_version"]), int(metadata["length"])
    except (ValueError, TypeError) as err:
        raise RecordError(f"wrong format: {err}") from err
    names = {"routes"} | {f"{layer}.{site}.{n}" for layer, site in keys for n in _SITE_TENSORS}
    unexpected = sorted(set(tensors) - names)
    if unexpected or "routes" not in tensors:
        raise RecordError(f"mis-shaped record: unexpected tensors {unexpected} or no routes")
    try:
        sites = {}
        for layer, site in keys:
            prefix = f"{layer}.{site}."
            sites[(layer, site)] = SiteRecord(tensors[prefix + "scales"], tensors[prefix + "payload"],
                                              tensors.get(prefix + "global_scale"))
        record = QuantRecord(sites, tensors["routes"], version, metadata["mode"], fmt, metadata["model_id"])
    except (KeyError, ValueError) as err:
        raise RecordError(f"mis-shaped record: {err}") from err
    if record.length != length:
        raise RecordError(f"mis-shaped record: routes cover {record.length} positions, metadata says {length}")
    return record


def load_record(source: bytes | str | Path, *, expected_version: int | None = None,
                fmt: FP4Format | str | None = None, mode: str | None = None, model: ModelIdentity | None = None,
                max_bytes: int = MAX_RECORD_BYTES) -> QuantRecord:
    """Load and validate a record; raise RecordError rather than return anything half-valid.

    expected_version: the oldest policy version the caller accepts (older records are stale).
    fmt / mode: the activation format and guidance mode the caller will use the record with.
    model: the model the caller will use the record with (weights fingerprint, layers, top-k, experts).
    max_bytes: larger files are refused unread.
    """
    record = _build(*_read(source, max_bytes))
    if model is not None:
        try:
            model.check(record)
        except ValueError as err:
            raise RecordError(f"wrong model: {err}") from err
    if fmt is not None and record.fmt != (want := parse_format(fmt)):
        raise RecordError(f"wrong format: record is {format_name(record.fmt)}, expected {format_name(want)}")
    if mode is not None and record.mode != mode:
        raise RecordError(f"wrong format: record mode is {record.mode!r}, expected {mode!r}")
    if expected_version is not None and record.policy_version < expected_version:
        raise RecordError(f"stale record: policy version {record.policy_version} is older than the expected "
                          f"{expected_version}")
    return record


class RecordExchange:
    """In-memory rollout -> training transport of records as bytes, with byte and time counters."""

    def __init__(self) -> None:
        self._pending: dict[int, list[bytes]] = {}
        self._next_ticket = 0
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.bytes_sent = 0
        """Serialized bytes (headers included) since the last reset."""
        self.payload_bytes = 0
        """Tensor payload bytes since the last reset (what bytes_per_token counts)."""
        self.tokens = 0
        self.ms = 0.0
        """Milliseconds spent serializing and loading."""

    def send(self, records: Sequence[QuantRecord]) -> int:
        """Serialize a batch of records; returns the ticket that receives them."""
        start = time.perf_counter()
        blobs = [save_record(r) for r in records]
        self.ms += 1000 * (time.perf_counter() - start)
        self.bytes_sent += sum(len(b) for b in blobs)
        self.payload_bytes += sum(serialized_payload_bytes(b) for b in blobs)
        self.tokens += sum(r.length for r in records)
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._pending[ticket] = blobs
        return ticket

    def receive(self, ticket: int, *, expected_version: int | None = None, fmt: FP4Format | str | None = None,
                mode: str | None = None, model: ModelIdentity | None = None) -> list[QuantRecord]:
        """Load a sent batch (all validated, or RecordError for the whole batch); a ticket is received once."""
        if ticket not in self._pending:
            raise KeyError(f"no pending records for ticket {ticket}")
        start = time.perf_counter()
        blobs = self._pending.pop(ticket)
        try:
            return [load_record(b, expected_version=expected_version, fmt=fmt, mode=mode, model=model) for b in blobs]
        finally:
            self.ms += 1000 * (time.perf_counter() - start)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def metrics(self) -> dict[str, float]:
        """``guidance/bytes_per_token`` (payload per token), ``guidance/exchange_bytes``, ``guidance/exchange_ms``."""
        return {
            "guidance/bytes_per_token": self.payload_bytes / max(self.tokens, 1),
            "guidance/exchange_bytes": float(self.bytes_sent),
            "guidance/exchange_ms": self.ms,
        }
