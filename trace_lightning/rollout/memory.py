"""What a generate call keeps on the device, from shapes alone: the engine's answer to "how large a batch fits".

Three things grow with the batch and stay for the whole call: the KV cache (FP4 or dense, per layer), the packed
record of the captured (layer, site) pairs (one byte row per position, parity bits or codes as the capture asks)
and the routes of every layer (uint8 ids). The weights are fixed. A forward's transient memory (activations, the
kernels' buffers, the logits), its workspace, is measured rather than derived: the peak bytes a real forward of a
few rows allocates beyond what it keeps (``peak_transient_bytes``: the CUDA allocator's peak on a GPU, the live
tensors' bytes elsewhere), extrapolated in the rows, whose work is independent. A large prefill's workspace exceeded
everything else on the GPU (48 layers, 131K prompt tokens: +16-20 GiB over the shapes' plan), so a plan counts it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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
    handover: int = 0
    """What the call hands over beside its buffers: the route table (a new tensor) and, from a decode session kept
    for the next call, a copy of the record (the session's own buffer is overwritten by that call)."""
    workspace: int = 0
    """The largest forward's transient bytes (the prefill's, or a decode step's), where measured."""

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.records + self.routes + self.refill_cache + self.handover
                + self.workspace)


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
         record_width: int, slots: int | None = None, ring: int = 0, kept_len: int | None = None) -> MemoryPlan:
    """The plan for an engine computing in `dtype` whose cache is FP4 in `kv_fmt` (None: dense), recording
    `record_width` bytes per position (its RecordLayout's width; 0 without capture). With `slots` below `batch`
    (continuous batching) the cache holds `slots` rows plus a refill's staging rows; records and routes stay one
    row per sequence. With a `ring` (columns of a record streamed to the host) the device holds only the ring, one
    row per slot, with each entry's position and sequence (int64). `kept_len`: the call runs in a decode session
    kept for the next call, whose buffers are that long (rounded up from max_len), and hands its record over as a
    copy of max_len positions."""
    held = max_len if kept_len is None else kept_len
    route_bytes = torch.empty(0, dtype=route_dtype(config.n_experts)).element_size()
    routes_per_position = config.n_layers * config.top_k * route_bytes
    cache_row = round(held * kv_bytes_per_token(config, dtype, kv_fmt))
    rows = batch if slots is None or slots >= batch else slots
    records, host = batch * held * record_width, 0
    if ring and record_width:
        records, host = rows * ring * (record_width + 16), records
    copied = batch * max_len * record_width if kept_len is not None and not ring else 0
    return MemoryPlan(weights=weights, kv_cache=rows * cache_row, records=records,
                      routes=batch * held * routes_per_position,
                      refill_cache=rows * cache_row if rows < batch else 0, host_records=host,
                      handover=batch * max_len * routes_per_position + copied)


def largest_batch(per_sequence: int, weights: int, budget: int, reserve: int) -> int:
    """The most sequences whose per-sequence bytes fit in budget - weights - reserve (0 when none fits)."""
    room = budget - weights - reserve
    return max(0, room // per_sequence) if per_sequence > 0 else 0


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storage that ops inside the block allocate and hold at once (a storage counts until
    the last tensor on it dies). What a caching allocator must find, without its rounding or fragmentation: the CPU's
    stand-in for torch.cuda.max_memory_allocated. Storage an op reads before any op made it existed before the block
    (weights, caches): views of it are not new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [tensors alive on it, bytes]
        self._known: set[int] = set()

    def __enter__(self) -> LiveBytes:
        super().__enter__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's API)
        inputs = _tensors((args, kwargs))
        before = {id(t) for t in inputs}
        self._known |= {key for t in inputs if t.device.type != "meta"
                        and (key := t.untyped_storage().data_ptr()) not in self._refs}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            if id(t) not in before:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self._refs.get(key)
        if entry is None:
            if key in self._known:  # storage from before the block (a view of a weight, say): not this block's
                return
            entry = self._refs[key] = [0, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]


def _tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _tensors(item)]
    return []


def peak_transient_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """The peak bytes fn allocates beyond what existed when it started (its result included while it lives):
    the CUDA allocator's peak on a GPU (which this resets: read a call's own peak before measuring), LiveBytes
    elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    with LiveBytes() as live:
        fn()
    return live.peak
