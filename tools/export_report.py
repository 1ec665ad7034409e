"""How an exported compressed-tensors folder relates to the engine, in numbers (docs/export.md).

For a preset with random weights: compressed-tensors' own fp32 dequantization against the engine's weights
(elements bit-equal, largest ulp distance), how often 1 / (1 / g) gives g back, how many elements ``load_hf``
moves for the round trip, compressed-tensors' own requantization of the same master weights against our bytes,
and the logits of transformers on the decompressed folder against the engine's W4A16 logits.

    python tools/export_report.py [--preset debug-moe] [--fmt nvfp4]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trace_lightning.export import export_compressed
from trace_lightning.model import MoEConfig, Transformer, load_hf, to_hf_state_dict
from trace_lightning.quant import decode_e2m1, unpack_fp4
from trace_lightning.rollout.engine import Engine
from trace_lightning.rollout.precision import FP4Precision


def ct_dense(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object]:
    """compressed-tensors' fp32 dequantization of every packed module, and the raw tensors."""
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors, dense = load_file(folder / "model.safetensors"), {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            m = key.removesuffix("_packed")
            codes = unpack_fp4_from_uint8(t, t.shape[0], 2 * t.shape[1], dtype=torch.float32)
            scale = compressor._decompress_scale(tensors[m + "_scale"], torch.float32)
            dense[m] = dequantize(codes, scale, args=scheme.weights, dtype=torch.float32,
                                  global_scale=tensors.get(m + "_global_scale"))
        elif not key.endswith(("_scale", "_global_scale")):
            dense[key] = t
    return dense, tensors, scheme


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def ct_requantize(w: torch.Tensor, amax: torch.Tensor, args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own NVFP4 quantization of w [out, in] under the global scale of amax (E2M1 values,
    block scales)."""
    gs = generate_gparam(-amax, amax)
    blocks = w.float().unflatten(-1, (-1, 16))
    scales, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
    values = quantize(w, scales, None, args, global_scale=gs)
    return values.float(), scales.float()


def report(preset: str, fmt: str, master_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Transformer(MoEConfig.from_name(preset)).to(master_dtype)
    kind, _, mode = fmt.partition(":")
    precision = FP4Precision(kind, mode or "floor", activations=False, kv=False, compute_dtype="fp32")
    engine = Engine(copy.deepcopy(model), precision, backend="sim")
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_compressed(model, Path(tmp) / "out", fmt)
        dense, tensors, scheme = ct_dense(folder)
        loaded = to_hf_state_dict(load_hf(folder))
        engine_w = to_hf_state_dict(_engine_dense(engine, model))
        packed = [k for k in dense if k + "_packed" in tensors]
        d = torch.cat([ulps(dense[k], engine_w[k]).flatten() for k in packed])
        moved = sum(int((loaded[k] != engine_w[k]).sum()) for k in packed)
        n = d.numel()
        print(f"{preset} {fmt} master {str(master_dtype).removeprefix('torch.')}: {len(packed)} packed modules, "
              f"{n} weights")
        print(f"  compressed-tensors fp32 dequant == engine weight: {int((d == 0).sum()) / n:.4f} of elements, "
              f"max {int(d.max())} ulp, {int((d == 1).sum())} at 1 ulp, "
              f"{int((d == 2).sum())} at 2 ulp")
        if kind == "nvfp4":
            notes = json.loads((folder / "fp4_export.json").read_text())["global_scales"]
            g = torch.tensor([float.fromhex(v) for v in notes.values()])
            back = torch.div(torch.ones_like(g), torch.div(torch.ones_like(g), g))
            print(f"  1 / (1 / g) == g for {int((back == g).sum())} of {g.numel()} module global scales")
            _requant_report(model, tensors, packed, scheme)
        again = Engine(load_hf(folder), precision, backend="sim").weight_checksums()
        same = sum(again[k] == v for k, v in engine.weight_checksums().items())
        print(f"  load_hf moved {moved} of {n} elements; round trip: {same} of {len(again)} FP4 weights with "
              "identical bytes (sha256 of codes, block scales, global scales)")
        _logits_report(folder, dense, engine, model.config)


def _engine_dense(engine: Engine, model: Transformer) -> Transformer:
    """A copy of the model holding the engine's fp32 FP4 weights (its dequantization, as it computes)."""
    from trace_lightning.sim._weights import dequantize_weight

    out = copy.deepcopy(model).float()
    with torch.no_grad():
        for name, (module, key) in engine._fp4_weights.items():
            q = module.quantized()[key]
            w = module.dense.get(key) if isinstance(module.dense, dict) else module.dense
            out.get_parameter(name).copy_(dequantize_weight(q) if w is None else w)
    return out


def _requant_report(model: Transformer, tensors: dict, packed: list[str], scheme: object) -> None:
    """compressed-tensors quantizing the same master weights (global scale from the same fused matrix)."""
    hf_master = to_hf_state_dict(model)
    amax_of = {}  # q/k/v share the fused matrix's amax, an expert's gate/up theirs
    for k in packed:
        base = k.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        group = [base, base.replace("q_proj", "k_proj"), base.replace("q_proj", "v_proj")] if "q_proj" in base else \
            [base, base.replace("gate_proj", "up_proj")] if "gate_proj" in base else [base]
        amax_of[k] = max(hf_master[m].float().abs().max() for m in group)
    codes_diff = scales_diff = total = blocks = globals_diff = 0
    for k in packed:
        values, scales = ct_requantize(hf_master[k], amax_of[k].reshape(1), scheme.weights)
        globals_diff += int(generate_gparam(-amax_of[k], amax_of[k]).item() != tensors[k + "_global_scale"].item())
        ours = decode_e2m1(unpack_fp4(tensors[k + "_packed"]))
        codes_diff += int((values != ours).sum())
        scales_diff += int((scales != tensors[k + "_scale"].float()).sum())
        total, blocks = total + ours.numel(), blocks + scales.numel()
    print(f"  compressed-tensors requantizing the master weights: {codes_diff} of {total} E2M1 values and "
          f"{scales_diff} of {blocks} block scales differ from ours; its global scale 2688 / amax differs from our "
          f"1 / (amax / 2688) for {globals_diff} of {len(packed)} modules")


def _logits_report(folder: Path, dense: dict, engine: Engine, config: MoEConfig) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["quantization_config"]
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.float() for k, v in dense.items()}, str(Path(tmp) / "model.safetensors"))
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        ids = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            diff = (hf(ids).logits - engine.model(ids)).abs().max()
        print(f"  transformers (decompressed, fp32) vs engine W4A16 fp32 logits: max |diff| {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="debug-moe")
    parser.add_argument("--fmt", default="nvfp4")
    parser.add_argument("--master-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    report(args.preset, args.fmt, getattr(torch, args.master_dtype))


if __name__ == "__main__":
    main()
