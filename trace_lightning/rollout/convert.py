"""FP4 weight converter: swap the model's ``Linear`` and ``Experts`` modules for FP4 ones (gpt-fast style).

Weight codes must agree with the trainer's QAT by construction, so the converter quantizes exactly the
tensor it is given (the master weights, values and dtype as they are) with the same per-matrix quantizer
(``FP4Format.for_weights()``: one NVFP4 global scale per matrix, per expert for stacked experts; MXFP4 has
none), and an audit compares a sha256 of the FP4 bytes computed on both sides (``fp4_weight_checksums``).
Boundary (bf16) layers are not converted: the model never calls the hook there, so QAT does not quantize them.

NVFP4 modules run ``ops.fp4_linear`` / ``ops.fp4_moe`` from the chosen backend. The op contract has no MXFP4
GEMMs yet, so MXFP4 modules keep their weights dequantized once per update and run dense GEMMs (same values,
dense memory); their ``moe_down`` then goes through the activation hook.

A weight update writes the new codes and scales into the tensors the module already holds (``set_weight``): a CUDA
graph the engine captured reads weights at their addresses, so it stays valid across weight syncs.

``dense_from`` (the engine's ``prefill_dense_from``): a forward of at least that many tokens (a large prefill) runs
dense GEMMs on the weight dequantized for that forward instead of the FP4 kernels, whose advantage is reading 4.5
bits a weight, which stops paying once a GEMM is compute-bound. Same weight values, a transient dense copy.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import re
from collections.abc import Callable, Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trace_lightning.guidance.identity import tensor_digests
from trace_lightning.model.config import MoEConfig
from trace_lightning.model.hooks import QuantHook
from trace_lightning.model.model import Experts, Linear, grouped_experts
from trace_lightning.quant import NVFP4, BlockFP4, FP4Format, parse_format, quantize_weight
from trace_lightning.quant.words import canonical
from trace_lightning.rollout.capture import FP4ActivationHook

FP4_WEIGHT_NAME = re.compile(
    r"^layers\.(\d+)\.(attn\.wqkv\.weight|attn\.wo\.weight|moe\.experts\.w13|moe\.experts\.w2"
    r"|moe\.shared\.w13\.weight|moe\.shared\.w2\.weight)$"
)


class WeightChecksumError(ValueError):
    """The rollout's FP4 weight bytes differ from the trainer's quantization of the same tensor."""


def is_fp4_weight(name: str, config: MoEConfig | None = None) -> bool:
    """True for the matrices the rollout holds in FP4 (outside the config's boundary layers, if given)."""
    m = FP4_WEIGHT_NAME.match(name)
    return m is not None and (config is None or config.is_quantized_layer(int(m.group(1))))


def fp4_checksum(q: BlockFP4) -> str:
    """sha256 of an FP4 tensor's format and shape and the byte digests (guidance/identity.py, taken on the tensors'
    device: no copy to the host) of its packed codes, scale bytes and (NVFP4) global scales."""
    parts = {"packed": q.packed, "scales": q.scale_bytes()}
    if isinstance(q, NVFP4) and q.global_scale is not None:
        parts["global_scale"] = q.global_scale.float()
    digests = tensor_digests(parts)
    h = hashlib.sha256(f"{type(q).__name__}:{tuple(q.shape)}".encode())
    for name, digest in digests.items():
        h.update(f"{name}={digest};".encode())
    return h.hexdigest()


def fp4_weight_checksums(named_tensors: Mapping[str, Tensor], fmt: FP4Format | str, *,
                         config: MoEConfig | None = None) -> dict[str, str]:
    """The trainer's side of the audit: {name: sha256 of its FP4 bytes} for every FP4 weight among the tensors.

    Pass the model config to leave out its boundary layers (which the rollout keeps unquantized).
    """
    return {name: fp4_checksum(quantize_weight(t, fmt)) for name, t in named_tensors.items()
            if is_fp4_weight(name, config)}


def check_weight_checksums(expected: Mapping[str, str], actual: Mapping[str, str]) -> None:
    """Raise WeightChecksumError naming every tensor whose checksum is missing or differs."""
    bad = sorted(name for name in expected if actual.get(name) != expected[name])
    if bad:
        raise WeightChecksumError(f"FP4 weight bytes differ between trainer and rollout for {len(bad)} tensor(s): "
                                  f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}")


def _bind(op: Callable, compute_dtype: torch.dtype) -> Callable:
    """The op with the sim's compute_dtype option set when the backend has it (kernels do not)."""
    if "compute_dtype" in inspect.signature(op).parameters:
        return functools.partial(op, compute_dtype=compute_dtype)
    return op


class FP4Linear(nn.Module):
    """A projection with an FP4 weight; replaces ``model.Linear`` and ignores ``hook.weight``."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, layer: int, name: str, fmt: FP4Format,
                 ops: ModuleType, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.layer, self.name, self.fmt, self.compute_dtype = layer, name, fmt, compute_dtype
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
        self._linear = _bind(ops.fp4_linear, compute_dtype)
        self._quantize = functools.partial(ops.prepared_weight, compute_dtype=compute_dtype)
        self.q: BlockFP4 | None = None
        self.dense: Tensor | None = None
        self.set_weight("weight", weight)

    def set_weight(self, key: str, w: Tensor) -> bool:
        """Re-quantize from a master weight [N, K] (held in the backend's fastest layout), into the tensors held
        so far where they fit. -> whether any tensor the forward reads moved (was replaced, not overwritten)."""
        self.q, moved = _write_into(self.q, self._quantize(w.detach(), self.fmt))
        dense = None if isinstance(self.q, NVFP4) else self.q.dequantize(self.compute_dtype)
        self.dense, moved_dense = _write_tensor_into(self.dense, dense)
        return moved or moved_dense

    def quantized(self) -> dict[str, BlockFP4]:
        """The FP4 weight in stored order (what checksums and records compare)."""
        return {"weight": canonical(self.q)}

    dense_from: int | None = None
    """Forwards of at least this many tokens run a dense GEMM on the weight dequantized for the call (None: never)."""

    def forward(self, x: Tensor, hook: QuantHook | None = None) -> Tensor:
        if self.dense is not None:
            y = F.linear(x, self.dense)
        elif _is_large(x, self.in_features, self.dense_from):
            y = F.linear(x, canonical(self.q).dequantize(x.dtype))
        else:
            y = self._linear(x.reshape(-1, self.in_features), self.q, out_dtype=x.dtype)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class FP4Experts(nn.Module):
    """Routed experts with FP4 w13 [E, 2I, D] and w2 [E, D, I]; replaces ``model.Experts``.

    With NVFP4 one fused ``ops.fp4_moe`` call does both GEMMs and, under an FP4 activation hook, quantizes
    ``moe_down`` per pair row itself; that NVFP4 goes to the hook's recorder.
    """

    def __init__(self, w13: Tensor, w2: Tensor, *, config: MoEConfig, layer: int, fmt: FP4Format,
                 ops: ModuleType, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.layer, self.fmt, self.compute_dtype = config, layer, fmt, compute_dtype
        self._moe = _bind(ops.fp4_moe, compute_dtype)
        self._quantize = functools.partial(ops.prepared_weight, compute_dtype=compute_dtype)
        self.q: dict[str, BlockFP4] = {}
        self.dense: dict[str, Tensor] = {}
        self.set_weight("w13", w13)
        self.set_weight("w2", w2)

    def set_weight(self, key: str, w: Tensor) -> bool:
        """Re-quantize from master experts [E, N, K] (held in the backend's fastest layout), into the tensors held
        so far where they fit. -> whether any tensor the forward reads moved."""
        self.q[key], moved = _write_into(self.q.get(key), self._quantize(w.detach(), self.fmt))
        if isinstance(self.q[key], NVFP4):
            return moved
        dense = self.q[key].dequantize(self.compute_dtype)
        self.dense[key], moved_dense = _write_tensor_into(self.dense.get(key), dense)
        return moved or moved_dense

    def quantized(self) -> dict[str, BlockFP4]:
        """The FP4 weights in stored order (what checksums and records compare)."""
        return {key: canonical(q) for key, q in self.q.items()}

    dense_from: int | None = None
    """Forwards of at least this many tokens run dense GEMMs on weights dequantized for the call (None: never)."""

    def forward(self, x: Tensor, ids: Tensor, gates: Tensor, hook: QuantHook | None = None) -> Tensor:
        """x (B, T, D), ids and gates (B, T, K) -> (B, T, D)."""
        if self.dense:
            return self._forward_dense(x, ids, gates, hook, self.dense)
        if _is_large(x, self.config.dim, self.dense_from):
            weights = {key: canonical(q).dequantize(x.dtype) for key, q in self.q.items()}
            return self._forward_dense(x, ids, gates, hook, weights)
        (B, T, D), K = x.shape, ids.shape[-1]
        act = hook if isinstance(hook, FP4ActivationHook) and hook.quantizes("moe_down") else None
        out, h = self._moe(x.reshape(-1, D), self.q["w13"], self.q["w2"], ids.reshape(-1, K), gates.reshape(-1, K),
                           quantize_intermediate=act is not None)
        if act is not None and h is not None:
            act.observe(NVFP4(h.packed.reshape(B, T, K, -1), h.scales.reshape(B, T, K, -1),
                              h.global_scale.reshape(B, T, K, 1)), layer=self.layer, site="moe_down")
        return out.view(B, T, D)

    def _forward_dense(self, x: Tensor, ids: Tensor, gates: Tensor, hook: QuantHook | None,
                       dense: dict[str, Tensor]) -> Tensor:
        """Dequantized weights through the model's own grouped experts (one grouped GEMM each, no host read-back,
        so it stays capturable); the hook sees moe_down."""
        return grouped_experts(x, ids, gates, dense["w13"], dense["w2"], hook, self.layer)


FP4Module = FP4Linear | FP4Experts


def _write_into(held: BlockFP4 | None, new: BlockFP4) -> tuple[BlockFP4, bool]:
    """(the weight to hold, whether it moved): `new`'s tensors copied into `held`'s when both are the same kind of
    FP4 tensor with the same shapes, dtypes and layout flags; `new` itself otherwise (or when nothing was held)."""
    if held is None or type(held) is not type(new):
        return new, held is not None
    pairs = [(getattr(held, f.name), getattr(new, f.name)) for f in dataclasses.fields(new)]
    for a, b in pairs:
        same = (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                if isinstance(a, Tensor) and isinstance(b, Tensor) else not isinstance(a, Tensor) and a == b)
        if not same:
            return new, True
    for a, b in pairs:
        if isinstance(a, Tensor):
            a.copy_(b)
    return held, False


def _write_tensor_into(held: Tensor | None, new: Tensor | None) -> tuple[Tensor | None, bool]:
    """_write_into for a plain tensor (an MXFP4 module's dequantized weight), None meaning none."""
    if held is None or new is None or held.shape != new.shape or held.dtype != new.dtype:
        return new, held is not None
    return held.copy_(new), False


def _is_large(x: Tensor, features: int, dense_from: int | None) -> bool:
    return dense_from is not None and x.numel() // features >= dense_from


def convert_to_fp4(model: nn.Module, fmt: FP4Format | str, ops: ModuleType,
                   compute_dtype: torch.dtype) -> dict[str, tuple[FP4Module, str]]:
    """Replace every Linear / Experts of the quantized layers in place; return {weight name: (module, key)}."""
    fmt = parse_format(fmt).for_weights()
    config: MoEConfig = model.config
    targets: dict[str, tuple[FP4Module, str]] = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, (Linear, Experts)) or not config.is_quantized_layer(module.layer):
            continue
        kw = dict(layer=module.layer, fmt=fmt, ops=ops, compute_dtype=compute_dtype)
        if isinstance(module, Linear):
            new: FP4Module = FP4Linear(module.weight, module.bias, name=module.name, **kw)
            targets[f"{path}.weight"] = (new, "weight")
        else:
            new = FP4Experts(module.w13, module.w2, config=config, **kw)
            targets[f"{path}.w13"], targets[f"{path}.w2"] = (new, "w13"), (new, "w2")
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, new)
    return targets
