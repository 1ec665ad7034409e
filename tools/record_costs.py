"""What a record costs per token, site by site, for a model shape: the budget policy's price list.

For each activation site of one quantized layer: bytes per token of its record in full (4-bit codes) and parity
(1 mantissa bit) mode, scales and row globals included, as the packed layout stores them; then a whole layer, all
quantized layers, the routes, and the FP4 and BF16 KV caches for scale. Shapes alone, no weights: runs anywhere.

Run: python tools/record_costs.py --preset qwen3-30b-a3b [--fmt nvfp4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from trace_lightning.guidance import route_bytes_per_token
from trace_lightning.guidance.layout import RecordLayout, site_rows
from trace_lightning.model import MoEConfig
from trace_lightning.quant import parse_format
from trace_lightning.rollout.memory import kv_bytes_per_token


def costs(config: MoEConfig, fmt: str) -> dict[str, object]:
    fp4 = parse_format(fmt)
    layers = [i for i in range(config.n_layers) if config.is_quantized_layer(i)]
    sites = sorted(site_rows(config))
    out: dict[str, object] = {"preset": config.name, "format": fmt, "quantized_layers": len(layers)}
    for mode in ("full", "parity"):
        one = RecordLayout.for_model(config, fp4, mode, [(layers[0], s) for s in sites])
        every = RecordLayout.for_model(config, fp4, mode, [(i, s) for i in layers for s in sites])
        out[mode] = {"per_site": {s.key[1]: s.size for s in one.slots}, "layer": one.payload_bytes_per_token,
                     "all_layers": every.payload_bytes_per_token, "all_layers_row_width": every.width}
    out["routes"] = route_bytes_per_token(config)
    out["kv_fp4"] = kv_bytes_per_token(config, torch.bfloat16, fp4)
    out["kv_bf16"] = kv_bytes_per_token(config, torch.bfloat16, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--fmt", default="nvfp4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = costs(MoEConfig.from_name(args.preset), args.fmt)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
