"""Export an FP4 policy as a compressed-tensors checkpoint (``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``),
the format vLLM loads and llm-compressor writes.

The export writes the bytes our FP4 engine computes with, not a requantization: every matrix goes through the
engine's own weight quantizer (``rollout.convert.quantize_weight``: one NVFP4 global scale per matrix, per expert
for stacked experts) and is then split into the per-module tensors of the Hugging Face layout ``save_hf`` writes
(q/k/v rows of the fused ``wqkv``, gate/up halves of ``w13``, one module per expert). Splitting rows of one
quantized matrix leaves codes and block scales untouched, so q/k/v share one global scale, and so do an expert's
gate and up, as vLLM expects of fused projections. compressed-tensors dequantizes ``code * scale / global_scale``
where we compute ``code * (scale * g)``, so the file holds ``weight_global_scale = 1 / g`` (float32), and the two
products can differ in the last fp32 bits (docs/export.md).

What the engine keeps dense (embeddings, norms, lm_head, the routers, the shared-expert gate and the bf16
boundary layers) is written dense and listed in ``ignore``. Activations export as W4A16: our per-row dynamic
global scales have no counterpart in the format (its NVFP4 ``input_global_scale`` is one static value per layer).
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trace_lightning.model import MoEConfig, Transformer, config_to_hf, to_hf_state_dict
from trace_lightning.model.checkpoint_files import write_safetensors
from trace_lightning.model.hf import Rule, _layer_rules, family_for
from trace_lightning.model.hf_compressed import EXPORT_NOTES_FILE, GLOBAL, PACKED, SCALE
from trace_lightning.quant import NVFP4, BlockFP4, FP4Format, parse_format
from trace_lightning.rollout.convert import is_fp4_weight, quantize_weight
from trace_lightning.serving_files import BUILTIN, write_serving_files

QUANT_FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
WEIGHT_ARGS = {  # compressed-tensors' NVFP4A16 / MXFP4A16 presets, as its QuantizationArgs serialise
    "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
              "dynamic": False, "scale_dtype": "torch.uint8"},
}
DENSE_LINEAR = re.compile(r"moe\.router\.weight$|moe\.shared\.gate$")  # Linear modules in HF, dense in the engine
ACTIVATIONS_W4A16 = ("activations=True: our FP4 activations take a per-row dynamic global scale, which "
                     "{format} cannot express (its input_global_scale is one static value per layer); exporting "
                     "W4A16 (FP4 weights, activations left to the serving engine)")


def export_compressed(model: Transformer, out_dir: str | Path, fmt: FP4Format | str = "nvfp4",
                      activations: bool = False, *, tokenizer_from: str | Path | None = None,
                      max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``model`` (master weights) as a compressed-tensors FP4 folder that vLLM serves; return the folder.

    ``fmt``: "nvfp4", "mxfp4" or "mxfp4:rceil" (the engine's format names). ``tokenizer_from``: the checkpoint
    folder whose tokenizer is copied next to the weights, or ``"builtin"`` for the presets' character tokenizer;
    either way config.json and generation_config.json name its bos / eos / pad ids (``serving_files``). None
    writes the weights and config only. Safetensors shards hold at most ``max_shard_bytes``.
    """
    weight_fmt = parse_format(fmt).for_weights()
    name = QUANT_FORMAT[weight_fmt.kind]
    if activations:
        warnings.warn(ACTIVATIONS_W4A16.format(format=name), stacklevel=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, ignore, global_scales = compressed_state_dict(model, weight_fmt)
    dtype = model.norm.weight.dtype
    config_to_hf(model.config, dtype).save_pretrained(str(out))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = quantization_config(weight_fmt.kind, ignore)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(tensors, out, max_shard_bytes)
    notes = {"global_scales": global_scales} if weight_fmt.kind == "nvfp4" else {"mx_mode": weight_fmt.mx_mode}
    (out / EXPORT_NOTES_FILE).write_text(json.dumps(notes, indent=0) + "\n")
    if tokenizer_from is not None:
        write_serving_files(out, tokenizer_from, model.config.vocab_size)
    return out


def quantization_config(kind: str, ignore: list[str]) -> dict[str, Any]:
    """config.json's ``quantization_config``: one W4A16 group over every Linear not in ``ignore``."""
    name = QUANT_FORMAT[kind]
    group = {"targets": ["Linear"], "weights": dict(WEIGHT_ARGS[kind]), "input_activations": None,
             "output_activations": None, "format": name}
    return {"quant_method": "compressed-tensors", "format": name, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}}


def compressed_state_dict(model: Transformer, fmt: FP4Format) -> tuple[dict[str, Tensor], list[str], dict[str, str]]:
    """(HF-named tensors with every FP4 Linear packed, the dense Linear modules for ``ignore``, each NVFP4
    module's own global scale g as ``float.hex``: the file stores 1 / g, from which g does not always follow)."""
    c = model.config
    ours = _master_weights(model)
    tensors = to_hf_state_dict(model)
    ignore, global_scales = ["lm_head"], {}
    for layer, rule in _rules(c):
        name = rule.ours.format(i=layer)
        modules = [k.removesuffix(".weight") for k in rule.hf_keys(c, layer)]
        if not is_fp4_weight(name, c):
            ignore += modules + _expert_container(rule, layer) if DENSE_LINEAR.search(name) or is_fp4_weight(name) \
                else []
            continue
        q = quantize_weight(ours[name], fmt)
        for module, packed, g in zip(modules, split_fp4(rule, q, c), module_global_scales(rule, q, c), strict=True):
            del tensors[module + ".weight"]
            tensors.update({f"{module}.{k}": v for k, v in packed.items()})
            global_scales.update({} if g is None else {module: float(g).hex()})
    return tensors, list(dict.fromkeys(ignore)), global_scales


def _expert_container(rule: Rule, layer: int) -> list[str]:
    """``model.layers.{i}.mlp.experts`` for a per-expert rule: the name vLLM gives the fused MoE layer, for
    loaders that look it up in ``ignore`` instead of the per-expert module names."""
    return [rule.hf[0].split(".{j}")[0].format(i=layer)] if "{j}" in rule.hf[0] else []


def _rules(c: MoEConfig) -> Iterator[tuple[int, Rule]]:
    """(layer, rule) for every tensor ``save_hf`` writes, in its order."""
    family = family_for(c.hf_architecture)
    yield from _layer_rules(family, c)
    yield from ((i, rule) for i in range(c.n_layers) for rule in family.layouts[0])


def _master_weights(model: Transformer) -> dict[str, Tensor]:
    """The model's state dict, refused if it is not a plain Transformer or holds a non-finite FP4 weight."""
    if not isinstance(model, Transformer):
        raise TypeError(f"export_compressed needs a trace_lightning Transformer, got {type(model).__name__}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        missing = sorted(Transformer(model.config).state_dict().keys() - state.keys())
    if missing:
        raise ValueError(f"the model lacks {len(missing)} master weights (e.g. {missing[0]!r}); pass the trained "
                         "Transformer, not a copy an Engine converted to FP4 modules")
    for key in (k for k in state if is_fp4_weight(k, model.config)):
        if not bool(torch.isfinite(state[key]).all()):
            raise ValueError(f"weight {key!r} holds non-finite values; FP4 export needs finite weights")
    return state


def split_fp4(rule: Rule, q: BlockFP4, c: MoEConfig) -> list[dict[str, Tensor]]:
    """The FP4 tensor of one of our weights cut into the rule's HF modules: weight_packed, weight_scale and,
    for NVFP4, weight_global_scale (1 / our global scale, one value shared by all rows of the module)."""
    packed = rule.to_hf(q.packed, c)
    scales = rule.to_hf(q.scales if isinstance(q, NVFP4) else q.scale_bytes(), c)
    parts = [{PACKED: _cpu(p), SCALE: _cpu(s)} for p, s in zip(packed, scales, strict=True)]
    for part, g in zip(parts, module_global_scales(rule, q, c), strict=True):
        if g is not None:
            part[GLOBAL] = _cpu(torch.div(torch.ones_like(g), g))  # compressed-tensors divides by it
    return parts


def module_global_scales(rule: Rule, q: BlockFP4, c: MoEConfig) -> list[Tensor | None]:
    """Our global scale g (float32 [1]) of each of the rule's HF modules; None for MXFP4."""
    if not isinstance(q, NVFP4):
        return [None] * len(rule.to_hf(q.packed, c))
    rows = q.global_scale.float().expand(*q.packed.shape[:-1], 1)  # our g of every row
    scales = [g.flatten()[:1] for g in rule.to_hf(rows, c)]
    for g, piece in zip(scales, rule.to_hf(rows, c), strict=True):
        if not bool((piece == g).all()):
            raise AssertionError("one HF module spans rows of two global scales")
    return scales


def _cpu(t: Tensor) -> Tensor:
    return t.to("cpu").contiguous().clone()


# ---- CLI: trace-export CKPT_OR_HF_FOLDER OUT_DIR [--fmt nvfp4|mxfp4] -------------------------------------------

def load_policy(source: Path) -> tuple[Transformer, str | Path, str]:
    """(master model, where its tokenizer comes from: its checkpoint folder or ``"builtin"``, the run's FP4 format)
    of an HF folder or a trace-rl fit checkpoint."""
    from trace_lightning.model import load_hf

    if source.is_dir():
        return load_hf(source), source, "nvfp4"
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such checkpoint file or Hugging Face folder")
    from trace_lightning.lit.policy import build_policy, load_policy_weights

    hparams = _fit_checkpoint(source).get("hyper_parameters", {})
    hf_folder = hparams.get("checkpoint")
    model, _ = build_policy(hparams.get("model", "debug-moe"), hf_folder)
    load_policy_weights(model, str(source))
    return model, Path(hf_folder) if hf_folder else BUILTIN, (hparams.get("trace") or {}).get("fmt", "nvfp4")


def _fit_checkpoint(source: Path) -> dict[str, Any]:
    """A trace-rl fit checkpoint's contents; ValueError naming the file for anything torch cannot read as one."""
    try:
        ckpt = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (pickle, zip and torch each raise their own types on a bad file)
        raise ValueError(f"{source}: not a trace-rl checkpoint ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                         ) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{source}: not a trace-rl checkpoint (no 'state_dict')")
    return ckpt


def export(source: Path, out_dir: Path, fmt: str | None = None) -> Path:
    """Export a fit checkpoint or HF folder with its tokenizer; return the folder."""
    model, tokenizer_from, run_fmt = load_policy(source)
    return export_compressed(model, out_dir, fmt or run_fmt, tokenizer_from=tokenizer_from)


def main(argv: list[str] | None = None) -> int:
    """Console script ``trace-export``: prints the folder it wrote (one line on stdout) and exits 0; a source it
    cannot export is one line on stderr and exit status 2, as for a usage error."""
    parser = argparse.ArgumentParser(prog="trace-export", description="Export an FP4 policy as a compressed-tensors "
                                     "checkpoint (nvfp4-pack-quantized / mxfp4-pack-quantized) that vLLM serves, "
                                     "with its tokenizer and generation config. Prints the output folder.")
    parser.add_argument("source", type=Path, help="a trace-rl fit checkpoint (.ckpt) or a Hugging Face folder")
    parser.add_argument("out_dir", type=Path, help="output folder")
    parser.add_argument("--fmt", choices=["nvfp4", "mxfp4", "mxfp4:rceil"], default=None,
                        help="FP4 format (default: the fit run's trace.fmt, nvfp4 for an HF folder)")
    args = parser.parse_args(argv)
    try:
        out = export(args.source, args.out_dir, args.fmt)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        parser.exit(2, f"trace-export: error: {' '.join(str(e).split())}\n")
    print(out)
    return 0
