"""compressed-tensors FP4 export, checked by compressed-tensors and transformers themselves: the bytes are the
engine's, compressed-tensors' own fp32 dequantization gives the engine's weights, transformers runs the
decompressed folder with the engine's W4A16 logits, and load_hf reads the folder back."""

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.utils.match import is_match
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from trace_lightning.export import _rules, export_compressed, main
from trace_lightning.model import CheckpointError, MoEConfig, Transformer, load_hf, to_hf_state_dict
from trace_lightning.quant import NVFP4, BlockFP4, decode_e2m1
from trace_lightning.rollout.engine import Engine
from trace_lightning.rollout.precision import FP4Precision
from trace_lightning.sim._weights import dequantize_weight

V = 96
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, num_experts_per_tok=2)
FAMILIES = {
    "qwen3": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, moe_intermediate_size=32, num_experts=6),
    "qwen3-tied": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=64, num_experts=4,
                                         tie_word_embeddings=True),
    "olmoe": lambda: OlmoeConfig(**COMMON, intermediate_size=32, num_experts=6, pad_token_id=0, eos_token_id=1),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4),
    "qwen2-moe": lambda: Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                        num_experts=6),
}
# (family, format, bf16 first layers, bf16 last layers)
CASES = [("qwen3", "nvfp4", 0, 0), ("olmoe", "nvfp4", 1, 0), ("mixtral", "nvfp4", 0, 1), ("qwen2-moe", "nvfp4", 0, 0),
         ("qwen3-tied", "mxfp4", 0, 0), ("qwen2-moe", "mxfp4:rceil", 1, 0)]
IDS = [f"{f}-{fmt}-b{a}{b}" for f, fmt, a, b in CASES]
PROMPTS = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(1))
AUX = (".weight_scale", ".weight_global_scale")


def policy(family: str, tmp: Path, first: int = 0, last: int = 0) -> Transformer:
    """A tiny random policy of a family (through a transformers checkpoint, no hub), with bf16 boundary layers."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(FAMILIES[family]())
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp / "src")
    loaded = load_hf(tmp / "src")
    model = Transformer(dataclasses.replace(loaded.config, bf16_first_layers=first, bf16_last_layers=last))
    model.load_state_dict(loaded.state_dict())
    return model


def w4a16(model: Transformer, fmt: str) -> Engine:
    """The FP4 engine with FP4 weights only, computing in fp32 (on a copy: the engine converts in place)."""
    kind, _, mode = fmt.partition(":")
    precision = FP4Precision(kind, mode or "floor", activations=False, kv=False, compute_dtype="fp32")
    return Engine(copy.deepcopy(model), precision, backend="sim")


def engine_fp4(engine: Engine) -> dict[str, tuple[BlockFP4, Tensor]]:
    """{our weight name: (FP4 tensor, the float32 weight the engine computes with)}."""
    out = {}
    for name, (module, key) in engine._fp4_weights.items():
        q = module.quantized()[key]
        dense = module.dense.get(key) if isinstance(module.dense, dict) else module.dense
        out[name] = q, (dequantize_weight(q) if isinstance(q, NVFP4) else dense.float())
    return out


def by_module(engine: Engine, fn) -> dict[str, Tensor]:
    """fn(our FP4 tensor, our dense weight) split into HF modules by the checkpoint rules."""
    c, fp4 = engine.config, engine_fp4(engine)
    out = {}
    for layer, rule in _rules(c):
        name = rule.ours.format(i=layer)
        if name in fp4:
            pieces = rule.to_hf(fn(*fp4[name]), c)
            out.update({k.removesuffix(".weight"): t for k, t in zip(rule.hf_keys(c, layer), pieces, strict=True)})
    return out


def ct_decompress(folder: Path) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """compressed-tensors' own reading of the folder, in fp32: (dense HF state dict, E2M1 values and block scales
    of each packed module). Every packed module must be one its config quantizes, every dense Linear one it
    ignores."""
    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    tensors = load_file(folder / "model.safetensors")
    dense, values, scales = {}, {}, {}
    for key, t in tensors.items():
        module = key.removesuffix(".weight_packed")
        if key.endswith(AUX):
            continue
        if key == module:
            linear = key.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in key
            targeted = is_match(key.removesuffix(".weight"), nn.Linear(1, 1), scheme.targets, qc.ignore)
            assert not (linear and targeted), f"dense {key} would be read as quantized"
            dense[key] = t
            continue
        assert is_match(module, nn.Linear(1, 1), scheme.targets, qc.ignore), f"{module} is packed but not targeted"
        g = tensors.get(module + ".weight_global_scale")
        values[module] = unpack_fp4_from_uint8(t, t.shape[0], 2 * t.shape[1], dtype=torch.float32)
        scales[module] = compressor._decompress_scale(tensors[module + ".weight_scale"], torch.float32)
        dense[module + ".weight"] = dequantize(values[module], scales[module], args=scheme.weights,
                                               dtype=torch.float32, global_scale=g)
        state = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
        default = compressor.decompress(state, scheme)["weight"]  # its own API: the same values rounded to bf16
        assert torch.equal(default, dense[module + ".weight"].to(default.dtype)), module
    return dense, values, scales


def ulps(a: Tensor, b: Tensor) -> int:
    """Largest distance in fp32 units in the last place (same-sign finite values, zeros equal)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    assert bool(((a >= 0) == (b >= 0)).all() | ((a == 0) & (b == 0)).all()), "sign differs"
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Transformer, Path, Engine, str]]:
    out = {}
    for case, (family, fmt, first, last) in zip(IDS, CASES, strict=True):
        tmp = tmp_path_factory.mktemp(case)
        model = policy(family, tmp, first, last)
        out[case] = model, export_compressed(model, tmp / "out", fmt), w4a16(model, fmt), fmt
    return out


@pytest.mark.parametrize("case", IDS)
def test_packed_bytes_are_the_engines(case: str, exported: dict) -> None:
    model, folder, engine, _ = exported[case]
    tensors = load_file(folder / "model.safetensors")
    packed = by_module(engine, lambda q, w: q.packed)
    scales = by_module(engine, lambda q, w: q.scales.view(torch.uint8))
    assert packed and set(packed) == {k.removesuffix(".weight_packed") for k in tensors if k.endswith("_packed")}
    for module in packed:
        assert torch.equal(tensors[module + ".weight_packed"], packed[module]), module
        assert torch.equal(tensors[module + ".weight_scale"].view(torch.uint8), scales[module]), module
    c = model.config
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    moe = "block_sparse_moe" if c.hf_architecture.startswith("Mixtral") else "mlp"
    for i in range(c.n_layers):  # the boundary layers (and only they) are dense and ignored
        q_proj, experts = f"model.layers.{i}.self_attn.q_proj", f"model.layers.{i}.{moe}.experts"
        assert (q_proj + ".weight" in tensors) == (q_proj in ignore) == (experts in ignore) == \
            (not c.is_quantized_layer(i))
        assert f"model.layers.{i}.{moe}.gate" in ignore
    dense = to_hf_state_dict(model)
    for key, t in tensors.items():
        if key.endswith(".weight") or key.endswith(".bias"):
            assert torch.equal(t, dense[key]), key


@pytest.mark.parametrize("case", [c for c in IDS if "nvfp4" in c])
def test_fused_projections_share_one_global_scale(case: str, exported: dict) -> None:
    """q/k/v (one fused wqkv in the engine) and each expert's gate/up (one w13 matrix) carry the same scale."""
    _, folder, engine, _ = exported[case]
    tensors = load_file(folder / "model.safetensors")
    layer = engine.config.bf16_first_layers
    groups = [[f"model.layers.{layer}.self_attn.{p}_proj" for p in "qkv"]]
    experts = "block_sparse_moe.experts.{j}.{p}" if engine.config.hf_architecture.startswith("Mixtral") else \
        "mlp.experts.{j}.{p}_proj"
    names = ("w1", "w3") if "block_sparse" in experts else ("gate", "up")
    groups += [[f"model.layers.{layer}." + experts.format(j=j, p=p) for p in names] for j in range(2)]
    for group in groups:
        scales = {tensors[m + ".weight_global_scale"].item() for m in group}
        assert len(scales) == 1, group
    g = engine_fp4(engine)[f"layers.{layer}.attn.wqkv.weight"][0].global_scale
    assert tensors[groups[0][0] + ".weight_global_scale"].item() == torch.div(torch.ones(1), g.reshape(1)).item()


@pytest.mark.parametrize("case", IDS)
def test_compressed_tensors_dequantizes_to_the_engines_weights(case: str, exported: dict) -> None:
    """Codes and block scales exact; weights exact for MXFP4 and within 2 fp32 ulps for NVFP4 (the global scale
    is stored as its reciprocal: scale / (1 / g) against our scale * g)."""
    _, folder, engine, _ = exported[case]
    dense, values, scales = ct_decompress(folder)
    ours_values = by_module(engine, lambda q, w: decode_e2m1(q.codes()))
    ours_scales = by_module(engine, lambda q, w: q.scales.float() if isinstance(q, NVFP4) else q.block_multiplier())
    ours_weights = by_module(engine, lambda q, w: w)
    worst = 0
    for module, w in ours_weights.items():
        torch.testing.assert_close(values[module], ours_values[module], rtol=0, atol=0)
        torch.testing.assert_close(scales[module], ours_scales[module], rtol=0, atol=0)
        worst = max(worst, ulps(dense[module + ".weight"], w))
    assert worst == 0 if "mxfp4" in case else worst <= 2


def test_power_of_two_global_scales_make_compressed_tensors_bit_exact(tmp_path: Path) -> None:
    """With every matrix's amax at 2688 * 2^-11 the global scale 2^-11 and its reciprocal are exact, and
    compressed-tensors' weights equal the engine's bit for bit: the only difference is the reciprocal's rounding."""
    model = policy("qwen3", tmp_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "wqkv" in name or "wo" in name or "experts" in name:
                flat = p.view(-1, p.shape[-2] * p.shape[-1]) if p.dim() == 3 else p.view(1, -1)
                flat[:, 0] = 2688 * 2.0**-11
    folder = export_compressed(model, tmp_path / "out")
    dense, _, _ = ct_decompress(folder)
    for module, w in by_module(w4a16(model, "nvfp4"), lambda q, w: w).items():
        assert torch.equal(dense[module + ".weight"], w), module


@pytest.mark.parametrize("case", IDS[:5])
def test_transformers_runs_the_decompressed_folder_with_the_engines_logits(case: str, exported: dict,
                                                                          tmp_path: Path) -> None:
    _, folder, engine, _ = exported[case]
    dense, _, _ = ct_decompress(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(dense, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs, ours = hf(PROMPTS).logits, engine.model(PROMPTS)
    assert ours.dtype == theirs.dtype == torch.float32
    assert (theirs - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("case", IDS)
def test_load_hf_reads_the_engines_weights_and_boundary(case: str, exported: dict) -> None:
    """With the export's notes the master weights are the engine's, bit for bit, except a few elements moved by a
    few ulps so that quantizing again gives the same bytes: NVFP4 the matrix's largest magnitude (its global
    scale re-derives), MXFP4 RCEIL the largest of blocks whose top code is 3. Dense tensors are exact."""
    model, folder, engine, fmt = exported[case]
    loaded = load_hf(folder)
    assert (loaded.config.bf16_first_layers, loaded.config.bf16_last_layers) == \
        (model.config.bf16_first_layers, model.config.bf16_last_layers)
    ours, engine_weights = to_hf_state_dict(loaded), by_module(engine, lambda q, w: w)
    dense = to_hf_state_dict(model)
    assert ours.keys() == dense.keys()
    for key, t in ours.items():
        module = key.removesuffix(".weight")
        if module not in engine_weights:
            assert torch.equal(t, dense[key]), key
            continue
        w = engine_weights[module]
        assert ulps(t, w) <= (4 if fmt == "nvfp4" else 64), key
        top = w.abs().max() if fmt == "nvfp4" else w.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1)
        moved = t != w
        assert bool((w[moved].abs() == (top if fmt == "nvfp4" else top[moved])).all()), key
        assert fmt != "mxfp4" or not bool(moved.any()), key  # FLOOR blocks requantize as they are


@pytest.mark.parametrize("case", IDS)
def test_load_hf_without_our_scales_reads_what_compressed_tensors_reads(case: str, exported: dict,
                                                                        tmp_path: Path) -> None:
    """A folder another tool wrote (no fp4_export.json) reads by the format's definition: rtol=0, atol=0
    against compressed-tensors' fp32 decompression."""
    _, folder, _, _ = exported[case]
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    dense, _, _ = ct_decompress(tmp_path)
    ours = to_hf_state_dict(load_hf(tmp_path))
    assert ours.keys() == dense.keys()
    for key, t in dense.items():
        assert torch.equal(ours[key], t), key


@pytest.mark.parametrize("case", IDS)
def test_round_trip_gives_the_engine_the_same_fp4_bytes(case: str, exported: dict) -> None:
    """export -> load_hf -> engine: the same sha256 of codes, block scales and global scales for every weight."""
    _, folder, engine, fmt = exported[case]
    again = w4a16(load_hf(folder), fmt).weight_checksums()
    assert again.keys() == engine.weight_checksums().keys() and again == engine.weight_checksums()


def test_round_trip_needs_the_moved_amax(exported: dict, tmp_path: Path) -> None:
    """Without the moved amax elements (plain code * scale * g) some NVFP4 global scales re-derive one ulp off:
    the case the reader exists for."""
    model, folder, engine, _ = exported[IDS[0]]
    plain = copy.deepcopy(model)
    fp4 = engine_fp4(engine)
    with torch.no_grad():
        for name, (_, w) in fp4.items():
            plain.get_parameter(name).copy_(w)
    again = w4a16(plain, "nvfp4").weight_checksums()
    assert sum(again[k] != v for k, v in engine.weight_checksums().items()) > 0


def test_config_is_compressed_tensors_own_w4a16_preset(exported: dict) -> None:
    for case, (_, folder, _, _) in exported.items():
        qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
        preset = preset_name_to_scheme("NVFP4A16" if "nvfp4" in case else "MXFP4A16", ["Linear"])
        (scheme,) = qc.config_groups.values()
        group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        assert group["weights"] == preset.model_dump(mode="json")["weights"], case  # what compressed-tensors writes
        assert scheme.input_activations is None, case
        assert qc.format == ("nvfp4-pack-quantized" if "nvfp4" in case else "mxfp4-pack-quantized")
        assert "lm_head" in qc.ignore and qc.kv_cache_scheme is None


def test_activations_export_w4a16_and_say_so(tmp_path: Path) -> None:
    model = policy("qwen3", tmp_path)
    with pytest.warns(UserWarning, match="per-row dynamic global scale"):
        folder = export_compressed(model, tmp_path / "out", activations=True)
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"] is None


def test_bad_inputs_are_refused_by_name(tmp_path: Path) -> None:
    model = policy("qwen3", tmp_path)
    with pytest.raises(ValueError, match="master weights"):
        export_compressed(w4a16(model, "nvfp4").model, tmp_path / "engine")
    with torch.no_grad():
        model.layers[1].attn.wo.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wo\.weight"):
        export_compressed(model, tmp_path / "nan")


def test_load_hf_refuses_a_broken_compressed_folder(exported: dict, tmp_path: Path) -> None:
    _, folder, _, _ = exported[IDS[0]]
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj.weight_scale"
    tensors[key] = tensors[key].view(torch.uint8)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight: weight_scale must be torch.float8_e4m3fn"):
        load_hf(tmp_path)
    save_file(load_file(folder / "model.safetensors"), str(tmp_path / "model.safetensors"))
    notes = json.loads((folder / "fp4_export.json").read_text())
    notes["global_scales"]["model.layers.0.self_attn.q_proj"] = (0.5).hex()
    (tmp_path / "fp4_export.json").write_text(json.dumps(notes))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight: fp4_export\.json does not match weight_global_scale"):
        load_hf(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="format .* is not supported"):
        load_hf(tmp_path)


def test_trace_export_cli_from_a_folder_and_a_fit_checkpoint(tmp_path: Path) -> None:
    policy("qwen3", tmp_path)
    shutil.copy(tmp_path / "src" / "config.json", tmp_path / "weights-only.json")  # keep a copy: src gets a tokenizer
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={chr(32 + i): i for i in range(V)}, merges=[])).save(str(tmp_path / "src" /
                                                                                         "tokenizer.json"))
    assert main([str(tmp_path / "src"), str(tmp_path / "a"), "--fmt", "mxfp4"]) == 0
    out = tmp_path / "a"
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    debug = Transformer(MoEConfig.from_name("debug-moe"))
    with torch.no_grad():
        debug.tok_embeddings.weight.mul_(3.0)  # not what a fresh init gives
    ckpt = {"state_dict": {f"policy.{k}": v for k, v in debug.state_dict().items()},
            "hyper_parameters": {"model": "debug-moe", "checkpoint": None, "trace": {"fmt": "mxfp4"}}}
    torch.save(ckpt, tmp_path / "fit.ckpt")
    assert main([str(tmp_path / "fit.ckpt"), str(tmp_path / "b")]) == 0
    out = tmp_path / "b"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    loaded = load_hf(out)
    assert torch.equal(loaded.tok_embeddings.weight, debug.tok_embeddings.weight)  # the checkpoint's weights
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '\ntrace-export = "trace_lightning.export:main"\n' in pyproject


def test_sharded_export_reads_back_the_same(exported: dict, tmp_path: Path) -> None:
    model, folder, _, fmt = exported[IDS[1]]
    sharded = export_compressed(model, tmp_path / "sharded", fmt, max_shard_bytes=20_000)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    for a, b in zip(load_hf(folder).state_dict().values(), load_hf(sharded).state_dict().values(), strict=True):
        assert torch.equal(a, b)
