"""Compaction: which bits (full codes or parity) and which layers a record keeps (DESIGN.md section 5).

The rollout-training mismatch that matters most sits in the deeper layers, so a compact record keeps
parity bits plus scales only there. Layer policies are short strings so a config line can name them:

- ``all`` / ``none``: every quantized layer / no layer;
- ``last:K``: the K deepest quantized layers;
- ``deep:F``: the deepest fraction F of the quantized layers (rounded up, so deep:0.5 of 8 is 4 layers);
- ``budget:B``: the deepest layers whose site payload fits B bytes per token (taken from the deepest down,
  stopping at the first that does not fit; the routes, L * top_k bytes per token, come on top);
- ``auto``: the layers an audit measured any code mismatch in; ``auto:B``: the most mismatched layers
  first, while they fit B bytes per token.

Boundary (bf16) layers are never candidates: the model does not quantize them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trace_lightning.guidance.layout import ELEMENTS_PER_BYTE, GLOBAL_SCALE_BYTES, site_rows
from trace_lightning.guidance.record import QuantRecord
from trace_lightning.model import MoEConfig
from trace_lightning.quant import FP4Format, parse_format
from trace_lightning.quant.guided import check_guidance_mode

POLICY_KINDS = ("all", "none", "last", "deep", "budget", "auto")


@dataclass(frozen=True)
class LayerPolicy:
    """A parsed layer policy: its kind, its numeric argument (if any) and the text it came from."""

    kind: str
    value: float | None
    text: str


def _bad(text: str, why: str) -> ValueError:
    return ValueError(f"bad layer policy {text!r}: {why}; expected all, none, last:K, deep:F, budget:B, auto or auto:B")


def parse_layer_policy(policy: str | LayerPolicy) -> LayerPolicy:
    """Parse a policy string; a malformed one raises ValueError naming it."""
    if isinstance(policy, LayerPolicy):
        return policy
    if not isinstance(policy, str):
        raise _bad(repr(policy), f"not a string but {type(policy).__name__}")
    kind, sep, arg = policy.strip().partition(":")
    if kind not in POLICY_KINDS:
        raise _bad(policy, f"unknown kind {kind!r}")
    if kind in ("all", "none") or (kind == "auto" and not sep):
        if sep:
            raise _bad(policy, f"{kind} takes no argument")
        return LayerPolicy(kind, None, policy)
    try:
        value = float(arg)
    except ValueError:
        raise _bad(policy, f"argument {arg!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise _bad(policy, "the argument must be a finite number >= 0")
    if kind == "last" and value != int(value):
        raise _bad(policy, "K must be a whole number of layers")
    if kind == "deep" and value > 1:
        raise _bad(policy, "F is a fraction in [0, 1]")
    return LayerPolicy(kind, value, policy)


def rank_layers_by_mismatch(agreement: Mapping[int, float]) -> list[int]:
    """Layers from most to least mismatched (lowest code agreement first; ties: deeper first)."""
    return sorted(agreement, key=lambda layer: (agreement[layer], -layer))


def _take_while_fits(order: Iterable[int], bytes_per_layer: Mapping[int, float], budget: float) -> list[int]:
    chosen, used = [], 0.0
    for layer in order:
        if used + bytes_per_layer[layer] > budget:
            break
        chosen.append(layer)
        used += bytes_per_layer[layer]
    return chosen


def select_layers(policy: str | LayerPolicy, n_layers: int, bytes_per_layer: float | Mapping[int, float],
                  audit: Mapping[int, float] | None = None, *, quantized: Sequence[int] | None = None,
                  overhead: float = 0.0) -> list[int]:
    """The sorted layers a policy records.

    bytes_per_layer: payload bytes per token of one layer's record (a float when all layers cost the same),
    or a mapping layer -> bytes whose keys are the quantized layers. quantized: the non-boundary layers
    (default: the mapping's keys, else all). audit: code agreement per layer, for ``auto``. overhead:
    bytes per token spent regardless of layers (the routes), taken off a budget first.
    """
    p = parse_layer_policy(policy)
    if isinstance(bytes_per_layer, Mapping):
        candidates = sorted(bytes_per_layer if quantized is None else quantized)
        costs = dict(bytes_per_layer)
    else:
        candidates = sorted(range(n_layers) if quantized is None else quantized)
        costs = dict.fromkeys(candidates, float(bytes_per_layer))
    outside = [layer for layer in candidates if not 0 <= layer < n_layers or layer not in costs]
    if outside:
        raise ValueError(f"layers {outside} are not layers of an {n_layers}-layer model with a known cost")
    deepest_first = candidates[::-1]
    if p.kind == "all":
        chosen = candidates
    elif p.kind == "none":
        chosen = []
    elif p.kind == "last":
        chosen = deepest_first[: int(p.value)]
    elif p.kind == "deep":
        chosen = deepest_first[: math.ceil(p.value * len(candidates) - 1e-9)]
    elif p.kind == "budget":
        chosen = _take_while_fits(deepest_first, costs, p.value - overhead)
    else:
        if audit is None:
            raise ValueError(f"layer policy {p.text!r} needs a code-agreement audit per layer")
        ranked = [layer for layer in rank_layers_by_mismatch(audit) if layer in costs and layer in candidates]
        if p.value is None:
            chosen = [layer for layer in ranked if audit[layer] < 1.0]
        else:
            chosen = _take_while_fits(ranked, costs, p.value - overhead)
    return sorted(chosen)


def site_bytes_per_token(config: MoEConfig, fmt: FP4Format | str, mode: str) -> dict[str, float]:
    """Record payload bytes per token of each activation site of one quantized layer, from the shapes alone."""
    fmt, mode = parse_format(fmt), check_guidance_mode(mode)
    global_bytes = GLOBAL_SCALE_BYTES if fmt.kind == "nvfp4" and fmt.global_scale != "none" else 0
    return {site: float(rows * (k / ELEMENTS_PER_BYTE[mode] + k / fmt.block_size + global_bytes))
            for site, (rows, k) in site_rows(config).items()}


def layer_bytes_per_token(config: MoEConfig, fmt: FP4Format | str, mode: str,
                          sites: Iterable[str] | None = None) -> dict[int, float]:
    """Record payload bytes per token of each quantized layer recording `sites` (None: every site), from the shapes
    alone (no record needed)."""
    per_site, keep = site_bytes_per_token(config, fmt, mode), None if sites is None else set(sites)
    per_layer = sum(v for site, v in per_site.items() if keep is None or site in keep)
    return {layer: float(per_layer) for layer in range(config.n_layers) if config.is_quantized_layer(layer)}


def route_bytes_per_token(config: MoEConfig) -> float:
    """Bytes per token of the routed expert ids every record carries (uint8, int16 beyond 256 experts)."""
    return float(config.n_layers * config.top_k * (1 if config.n_experts <= 256 else 2))


@dataclass(frozen=True)
class Compaction:
    """What a record keeps: ``mode`` ("full" or "parity") and a layer policy string."""

    mode: str = "parity"
    layers: str = "all"

    def __post_init__(self) -> None:
        check_guidance_mode(self.mode)
        parse_layer_policy(self.layers)

    def layers_for(self, config: MoEConfig, fmt: FP4Format | str,
                   audit: Mapping[int, float] | None = None) -> list[int]:
        """The layers this compaction records for a model config."""
        return select_layers(self.layers, config.n_layers, layer_bytes_per_token(config, fmt, self.mode), audit)

    def apply(self, record: QuantRecord, layers: Iterable[int]) -> QuantRecord:
        return record.compact(self.mode, layers)
