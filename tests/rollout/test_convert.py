import pytest
import torch

from trace_lightning.guidance.identity import tensor_digests
from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.quant import FP4Format, fake_quantize, parse_format, quantize_mxfp4
from trace_lightning.rollout import (
    Engine,
    FP4Experts,
    FP4Linear,
    FP4Precision,
    SamplingParams,
    WeightChecksumError,
    fp4_weight_checksums,
    quantize_weight,
)
from trace_lightning.rollout.convert import fp4_checksum

FP4_NAMES = {f"layers.{i}.{n}" for i in range(2)
             for n in ("attn.wqkv.weight", "attn.wo.weight", "moe.experts.w13", "moe.experts.w2")}


def master(base_model: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in base_model.state_dict().items()}


def test_converter_swaps_modules_and_quantizes_master_weights(model: Transformer, base_model: Transformer) -> None:
    engine = Engine(model, FP4Precision())
    assert isinstance(engine.model.layers[0].attn.wqkv, FP4Linear)
    assert isinstance(engine.model.layers[1].moe.experts, FP4Experts)
    assert engine.model.output.weight.dtype == torch.bfloat16  # lm_head stays high precision
    w13 = base_model.layers[1].moe.experts.w13.detach()
    q = engine.model.layers[1].moe.experts.quantized()["w13"]
    assert torch.equal(q.packed, quantize_weight(w13, "nvfp4").packed)
    # One global scale per expert matrix, from the fp32 master weight (not from a bf16 copy).
    expected_g = w13.abs().amax(dim=(1, 2)) / (448 * 6)
    assert torch.equal(q.global_scale.flatten(), expected_g)
    for e in range(w13.shape[0]):
        assert torch.equal(q.packed[e], quantize_weight(w13[e], "nvfp4").packed)


def test_checksums_agree_with_trainer_side_and_change_on_update(model: Transformer, base_model: Transformer) -> None:
    engine = Engine(model, FP4Precision())
    named = master(base_model)
    ours = engine.weight_checksums()
    assert set(ours) == FP4_NAMES
    assert ours == fp4_weight_checksums(named, "nvfp4")
    engine.verify_weights(named)

    named["layers.1.moe.experts.w2"] = named["layers.1.moe.experts.w2"] * 1.5 + 0.01
    named["norm.weight"] = named["norm.weight"] * 2
    with pytest.raises(WeightChecksumError, match="layers.1.moe.experts.w2"):
        engine.verify_weights(named)
    assert engine.update_weights(named, version=7) == tensor_digests(named)  # what WeightSync fingerprints
    after = engine.weight_checksums()
    assert engine.policy_version == 7
    assert after == fp4_weight_checksums(named, FP4Format("nvfp4"))
    assert {k for k in after if after[k] != ours[k]} == {"layers.1.moe.experts.w2"}
    assert torch.equal(engine.model.norm.weight, named["norm.weight"].bfloat16())
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=1)).policy_version == 7


def test_mxfp4_checksums(model: Transformer, base_model: Transformer) -> None:
    engine = Engine(model, FP4Precision(fmt="mxfp4", mx_mode="rceil"))
    named = master(base_model)
    assert engine.weight_checksums() == fp4_weight_checksums(named, "mxfp4:rceil")
    assert engine.weight_checksums() != fp4_weight_checksums(named, "mxfp4:floor")
    wo = named["layers.0.attn.wo.weight"]
    assert torch.equal(engine.model.layers[0].attn.wo.dense, quantize_mxfp4(wo, "rceil").dequantize(torch.bfloat16))


def test_update_weights_rejects_unknown_names_and_shapes(model: Transformer, base_model: Transformer) -> None:
    engine = Engine(model, FP4Precision())
    before = engine.weight_checksums()
    good = master(base_model)["layers.0.attn.wo.weight"] * 2
    with pytest.raises(ValueError, match="unknown tensor 'layers.9.attn.wo.weight'"):
        engine.update_weights({"layers.0.attn.wo.weight": good, "layers.9.attn.wo.weight": good}, version=1)
    with pytest.raises(ValueError, match="'layers.0.moe.experts.w13' has shape \\(3, 4\\)"):
        engine.update_weights({"layers.0.moe.experts.w13": torch.zeros(3, 4)}, version=1)
    with pytest.raises(ValueError, match="'norm.weight' has shape"):
        engine.update_weights({"norm.weight": torch.zeros(5)}, version=1)
    assert engine.weight_checksums() == before and engine.policy_version == 0  # nothing was applied


def test_unquantized_engines_take_updates_too(model: Transformer, base_model: Transformer) -> None:
    engine = Engine(model, "fp32")
    named = master(base_model)
    named["output.weight"] = torch.zeros_like(named["output.weight"])
    engine.update_weights(named, version=3)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert engine.weight_checksums() == {} and out.policy_version == 3
    assert out.logprobs[0] == pytest.approx([-torch.log(torch.tensor(128.0)).item()] * 2)  # uniform logits


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4:rceil"])
@pytest.mark.parametrize("shape", [(96, 64), (4, 64, 32)])
def test_converter_quantizes_like_the_trainers_fake_quant(fmt: str, shape: tuple[int, ...]) -> None:
    """QAT's weight fake-quant (FP4Format.for_weights) and the converter give the same codes and values."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, shape[-1])
    weights = parse_format(fmt).for_weights()
    ours, theirs = quantize_weight(w, fmt), weights.quantize(w)
    assert torch.equal(ours.packed, theirs.packed) and torch.equal(ours.scale_bytes(), theirs.scale_bytes())
    assert torch.equal(ours.dequantize(), fake_quantize(w, weights))


@pytest.mark.parametrize("tiled", [False, True])
def test_fp4_modules_hold_the_backends_layout_and_report_stored_order(tiled: bool) -> None:
    """A backend that holds weights in the kernels' word layout, and in their tiles (as the Triton one does on CUDA
    bf16): the module keeps that layout for its GEMMs, `quantized()` (checksums, records) gives the stored order,
    outputs agree."""
    import types

    from trace_lightning import sim
    from trace_lightning.quant.words import WordNVFP4

    def words(w, fmt, compute_dtype):  # noqa: ANN001, ANN202
        return WordNVFP4.from_stored(sim.quantize_weight(w, fmt), tiled)

    ops = types.SimpleNamespace(fp4_linear=sim.fp4_linear, fp4_moe=sim.fp4_moe, prepared_weight=words)
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(32, 128, generator=gen), torch.randn(3, 128, generator=gen)
    fmt = parse_format("nvfp4")
    held = FP4Linear(w, None, layer=0, name="wo", fmt=fmt, ops=ops, compute_dtype=torch.float32)
    plain = FP4Linear(w, None, layer=0, name="wo", fmt=fmt, ops=sim, compute_dtype=torch.float32)
    assert isinstance(held.q, WordNVFP4) and held.q.tiled == tiled and not isinstance(plain.q, WordNVFP4)
    stored = quantize_weight(w, fmt)
    assert torch.equal(held.quantized()["weight"].packed, stored.packed)
    assert torch.equal(held.quantized()["weight"].scale_bytes(), stored.scale_bytes())
    assert fp4_checksum(held.quantized()["weight"]) == fp4_checksum(stored)
    assert torch.equal(held(x), plain(x))


def test_fp4_modules_requantize_through_the_backends_quantizer() -> None:
    """Construction and every weight sync quantize through `ops.prepared_weight` (on Triton: one kernel launch a
    tensor, layout included), never the reference's ~65 torch ops a tensor behind it: FP4Linear once did, for
    every attention projection, and the Triton engine's sync paid the reference's cost for them."""
    import types

    from trace_lightning import sim

    calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def counting(w: torch.Tensor, fmt: object, compute_dtype: torch.dtype) -> object:
        calls.append((tuple(w.shape), compute_dtype))
        return sim.prepared_weight(w, fmt, compute_dtype)

    ops = types.SimpleNamespace(fp4_linear=sim.fp4_linear, fp4_moe=sim.fp4_moe, prepared_weight=counting)
    gen = torch.Generator().manual_seed(7)
    w, w13, w2 = torch.randn(32, 64, generator=gen), torch.randn(4, 64, 32, generator=gen), torch.randn(
        4, 32, 32, generator=gen)
    fmt = parse_format("nvfp4")
    linear = FP4Linear(w, None, layer=0, name="wo", fmt=fmt, ops=ops, compute_dtype=torch.bfloat16)
    config = MoEConfig.from_name("debug-moe", dim=32, moe_intermediate=32, n_experts=4, top_k=2)
    experts = FP4Experts(w13, w2, config=config, layer=0, fmt=fmt, ops=ops, compute_dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    assert calls == [((32, 64), bf16), ((4, 64, 32), bf16), ((4, 32, 32), bf16)]
    linear.set_weight("weight", w * 2)
    experts.set_weight("w2", w2 * 2)
    assert calls[3:] == [((32, 64), bf16), ((4, 32, 32), bf16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_run_the_models_grouped_path_with_no_host_read_back(dtype: torch.dtype) -> None:
    """MXFP4 experts (dequantized once) and large NVFP4 prefills (dequantized for the call) run the model's grouped
    experts on those values, equal to the model's reference loop over the dequantized weights, with no op that
    reads the device back (unique, nonzero, item): a CUDA graph could not hold one (MXFP4's decode steps), and each
    stalls the host's launches behind the device (a large prefill's dequantization in every layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trace_lightning import sim
    from trace_lightning.model.model import Experts

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    config = MoEConfig(dim=64, moe_intermediate=32, n_experts=8, top_k=2)
    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(8, 64, 64, generator=gen) * 0.1, torch.randn(8, 64, 32, generator=gen) * 0.1
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(10)]).view(2, 5, 2)
    gates = torch.rand(2, 5, 2, generator=gen).to(dtype)
    for fmt, dense_from in (("mxfp4", None), ("nvfp4", 1)):
        experts = FP4Experts(w13, w2, config=config, layer=0, fmt=parse_format(fmt).for_weights(), ops=sim,
                             compute_dtype=dtype)
        experts.dense_from = dense_from
        with Ops() as seen:
            y = experts(x, ids, gates)
        read_back = seen.names & {"_unique2", "unique_dim", "nonzero", "_local_scalar_dense"}
        assert "_grouped_mm" in seen.names and not read_back, seen.names
        reference = Experts(config, layer=0)
        with torch.no_grad():
            for key, q in experts.quantized().items():
                getattr(reference, key).copy_(q.dequantize(torch.float32))
        expected = reference.to(dtype).forward_reference(x, ids, gates)
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
