"""What a generate call keeps on the device, from shapes alone: the engine's answer to "how large a batch fits".

Three things grow with the batch and stay for the whole call: the KV cache (FP4 or dense, per layer), the record
buffers of the captured (layer, site) pairs (the engine keeps full codes until compaction) and the routes of every
layer. The weights are fixed. Everything else (a forward's activations, the sampler's logits) is transient and is
budgeted as a reserve the caller chooses; the reserve's size is a measurement to make on the device, not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trace_lightning.guidance.compaction import site_bytes_per_token
from trace_lightning.model.config import MoEConfig
from trace_lightning.quant import FP4Format
from trace_lightning.rollout.batch import CaptureSpec

ROUTE_BYTES = 8  # the recorder's routes are int64


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a generate call of `batch` sequences of up to `max_len` positions holds on the device."""

    weights: int
    kv_cache: int
    records: int
    routes: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.records + self.routes


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


def record_bytes_per_token(config: MoEConfig, fmt: FP4Format, capture: CaptureSpec | None, activations: bool,
                           kv_fp4: bool) -> float:
    """Full-record bytes per position of the captured (layer, site) pairs that are FP4 (boundary layers have none;
    k and v only with an FP4 cache, the other sites only with FP4 activations)."""
    if capture is None:
        return 0.0
    per_site = site_bytes_per_token(config, fmt, "full")
    sites = [s for s in capture.site_set() if s in per_site and (kv_fp4 if s in ("k", "v") else activations)]
    layers = [i for i in capture.layer_set(config.n_layers) if config.is_quantized_layer(i)]
    return float(len(layers) * sum(per_site[s] for s in sites))


def plan(config: MoEConfig, weights: int, batch: int, max_len: int, dtype: torch.dtype, fmt: FP4Format | None,
         activations: bool, kv_fp4: bool, capture: CaptureSpec | None) -> MemoryPlan:
    """The plan for an engine computing in `dtype` whose FP4 activations / cache (if any) are in `fmt`."""
    positions = batch * max_len
    kv = kv_bytes_per_token(config, dtype, fmt if kv_fp4 else None)
    records = record_bytes_per_token(config, fmt, capture, activations, kv_fp4) if fmt is not None else 0.0
    return MemoryPlan(weights=weights, kv_cache=round(positions * kv), records=round(positions * records),
                      routes=positions * config.n_layers * config.top_k * ROUTE_BYTES)


def largest_batch(per_sequence: int, weights: int, budget: int, reserve: int) -> int:
    """The most sequences whose per-sequence bytes fit in budget - weights - reserve (0 when none fits)."""
    room = budget - weights - reserve
    return max(0, room // per_sequence) if per_sequence > 0 else 0
