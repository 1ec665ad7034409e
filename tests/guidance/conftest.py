"""Rollout emulation for the guidance tests: a recording hook on the model is exactly what the engine captures.

The "rollout" quantizes every site with FP4Format.quantize and the fp32 master weights with the per-matrix
format (dequantized to its compute dtype), and keeps per-sequence captures {(layer, site): BlockFP4 [T, ...]}
plus routes [L, T, k]: the shape the rollout engine's RolloutBatch carries.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from trace_lightning.guidance import QuantRecord
from trace_lightning.model import QuantHook, Transformer
from trace_lightning.quant import MXFP4, NVFP4, BlockFP4, FP4Format, parse_format, quantize_nvfp4, tensor_global_scale

WEIGHT_PATHS = {"attn.wqkv": "attn.wqkv.weight", "attn.wo": "attn.wo.weight", "moe.w13": "moe.experts.w13",
                "moe.w2": "moe.experts.w2"}


def first_row(q: BlockFP4) -> BlockFP4:
    """Drop the batch dim of a (1, T, ...) capture."""
    if isinstance(q, MXFP4):
        return MXFP4(packed=q.packed[0], scales=q.scales[0], mode=q.mode)
    assert isinstance(q, NVFP4)
    g = None if q.global_scale is None else q.global_scale[0]
    return NVFP4(packed=q.packed[0], scales=q.scales[0], global_scale=g)


class RecordingHook(QuantHook):
    """The rollout's numerics: FP4 activations (captured) and FP4 weights quantized from the fp32 masters."""

    def __init__(self, fmt: FP4Format, masters: dict[tuple[int, str], Tensor]) -> None:
        self.fmt, self.masters = fmt, masters
        self.captures: dict[tuple[int, str], BlockFP4] = {}

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        q = self.fmt.quantize(x)
        self.captures[(layer, site)] = q
        return q.dequantize(x.dtype)

    def weight(self, w: Tensor, *, layer: int, name: str) -> Tensor:
        return rollout_weight(self.masters[(layer, name)], self.fmt).dequantize(w.dtype)


def rollout_weight(w: Tensor, fmt: FP4Format) -> BlockFP4:
    """The engine's weight conversion: per-matrix (per-expert for [E, N, K]) NVFP4 global scale, or MXFP4."""
    if fmt.kind == "mxfp4":
        return fmt.quantize(w)
    g = tensor_global_scale(w, dims=2)
    return quantize_nvfp4(w, g.reshape(*w.shape[:-2], 1, 1) if w.dim() == 3 else g)


def masters_of(model: Transformer) -> dict[tuple[int, str], Tensor]:
    return {(i, name): block.get_parameter(path).detach()
            for i, block in enumerate(model.layers) for name, path in WEIGHT_PATHS.items()}


def emulate_rollout(model: Transformer, seqs: list[list[int]], fmt: FP4Format | str, dtype: torch.dtype
                    ) -> list[tuple[dict[tuple[int, str], BlockFP4], Tensor]]:
    """Per sequence (captures, routes [L, T, k]) from a forward of a `dtype` copy of the fp32 model."""
    fmt = parse_format(fmt)
    rollout_model = copy.deepcopy(model).to(dtype)
    masters = masters_of(model)
    out = []
    with torch.no_grad():
        for seq in seqs:
            hook = RecordingHook(fmt, masters)
            res = rollout_model(torch.tensor([seq]), hook=hook, return_routes=True)
            routes = torch.stack([r[0] for r in res.routes])  # (L, T, k)
            out.append(({k: first_row(q) for k, q in hook.captures.items()}, routes))
    return out


@pytest.fixture(scope="module")
def debug_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer.from_name("debug-moe", init_std=0.05)


@pytest.fixture(scope="module")
def engine_weight() -> Callable[[Tensor, FP4Format], BlockFP4]:
    """rollout_weight(w, fmt): the engine's FP4 conversion of a master weight."""
    return rollout_weight


@pytest.fixture(scope="module")
def rollout() -> Callable[..., list[tuple[dict[tuple[int, str], BlockFP4], Tensor]]]:
    """emulate_rollout(model, seqs, fmt, dtype)."""
    return emulate_rollout


@pytest.fixture(scope="module")
def make_records() -> Callable[..., list[QuantRecord]]:
    def make(model: Transformer, seqs: list[list[int]], fmt: str = "nvfp4", dtype: torch.dtype = torch.bfloat16,
             mode: str = "full", version: int = 3) -> list[QuantRecord]:
        captured = emulate_rollout(model, seqs, fmt, dtype)
        return [QuantRecord.from_captures(c, r, version, mode=mode) for c, r in captured]

    return make


@pytest.fixture(scope="module")
def batch_of() -> Callable[[list[int]], tuple[list[list[int]], Tensor, Tensor]]:
    """batch_of(lengths) -> (sequences, right-padded tokens (B, T), attention mask (B, T))."""

    def make(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], Tensor, Tensor]:
        seqs = sequences(lengths, seed=seed)
        return (seqs, *pad(seqs))

    return make


def sequences(lengths: list[int], vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def pad(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return tokens, mask
