"""What a generate call keeps on the device, from shapes alone: the engine's answer to "how large a batch fits".

Three things grow with the batch and stay for the whole call: the KV cache (FP4 or dense, per layer), the packed
record of the captured (layer, site) pairs (one byte row per position, parity bits or codes as the capture asks)
and the routes of every layer (uint8 ids). The weights are fixed. Everything else (a forward's activations, the
sampler's logits) is transient and is budgeted as a reserve the caller chooses; the reserve's size is a measurement
to make on the device, not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trace_lightning.guidance.compaction import site_bytes_per_token
from trace_lightning.guidance.record import route_dtype
from trace_lightning.model.config import MoEConfig
from trace_lightning.quant import FP4Format


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a generate call of `batch` sequences of up to `max_len` positions holds on the device."""

    weights: int
    kv_cache: int
    records: int
    routes: int
    refill_cache: int = 0
    """Continuous batching: the staging cache a refill prefills into (up to every slot's rows at once)."""
    host_records: int = 0
    """A record streamed to the host: its bytes there (pinned); ``records`` is then the device ring."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.records + self.routes + self.refill_cache


def tensor_bytes(module: nn.Module, extra: list[torch.Tensor]) -> int:
    """Bytes of a module's parameters and buffers plus tensors it holds outside them (FP4 weights), each once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers(), *extra]:
        seen[t.data_ptr() if t.device.type != "meta" else id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def kv_bytes_per_token(config: MoEConfig, dtype: torch.dtype, fp4: FP4Format | None) -> float:
    """Cache bytes per position of one sequence: dense layers in `dtype`, FP4 layers as codes + scales + globals."""
    per_head = config.n_kv_heads * config.head_dim
    dense = 2 * per_head * torch.empty(0, dtype=dtype).element_size()
    if fp4 is None:
        return float(config.n_layers * dense)
    fp4_layer = site_bytes_per_token(config, fp4, "full")
    packed = fp4_layer["k"] + fp4_layer["v"]
    quantized = sum(config.is_quantized_layer(i) for i in range(config.n_layers))
    return float(quantized * packed + (config.n_layers - quantized) * dense)


def plan(config: MoEConfig, weights: int, batch: int, max_len: int, dtype: torch.dtype, kv_fmt: FP4Format | None,
         record_width: int, slots: int | None = None, ring: int = 0) -> MemoryPlan:
    """The plan for an engine computing in `dtype` whose cache is FP4 in `kv_fmt` (None: dense), recording
    `record_width` bytes per position (its RecordLayout's width; 0 without capture). With `slots` below `batch`
    (continuous batching) the cache holds `slots` rows plus a refill's staging rows; records and routes stay one
    row per sequence. With a `ring` (columns of a record streamed to the host) the device holds only the ring, one
    row per slot, with each entry's position and sequence (int64)."""
    positions = batch * max_len
    route_bytes = torch.empty(0, dtype=route_dtype(config.n_experts)).element_size()
    cache_row = round(max_len * kv_bytes_per_token(config, dtype, kv_fmt))
    rows = batch if slots is None or slots >= batch else slots
    records, host = positions * record_width, 0
    if ring and record_width:
        records, host = rows * ring * (record_width + 16), records
    return MemoryPlan(weights=weights, kv_cache=rows * cache_row, records=records,
                      routes=positions * config.n_layers * config.top_k * route_bytes,
                      refill_cache=rows * cache_row if rows < batch else 0, host_records=host)


def largest_batch(per_sequence: int, weights: int, budget: int, reserve: int) -> int:
    """The most sequences whose per-sequence bytes fit in budget - weights - reserve (0 when none fits)."""
    room = budget - weights - reserve
    return max(0, room // per_sequence) if per_sequence > 0 else 0
