"""How kernels launch (kernels.KernelOptions): the options' scope, when programmatic dependent launch
(kernels._common.grid_dependency) is asked for, and that a chain of kernels started early computes what plain stream
order computes, byte for byte."""

import pytest
import torch

from trace_lightning import kernels
from trace_lightning.kernels._common import active_options, autotune_on, grid_dependency
from trace_lightning.quant import tensor_global_scale


def test_plain_launches_off_cuda_and_when_turned_off() -> None:
    assert grid_dependency(torch.device("cpu")) == {}  # the interpreter cannot run griddepcontrol
    with kernels.kernel_options(kernels.KernelOptions(pdl=False)):
        assert grid_dependency(torch.device("cuda")) == {}  # decided before the device is asked


def test_options_hold_inside_their_block_only() -> None:
    """kernel_options scopes: the innermost block's options, the defaults again after it (also after an error), and
    autotuning only where it is asked for and only on CUDA."""
    default = kernels.KernelOptions()
    assert active_options() == default and not autotune_on(torch.device("cuda"))
    tuned = kernels.KernelOptions(autotune=True)
    with pytest.raises(RuntimeError, match="inside"), kernels.kernel_options(tuned):
        assert active_options() is tuned
        assert autotune_on(torch.device("cuda")) and not autotune_on(torch.device("cpu"))
        with kernels.kernel_options(default):
            assert not autotune_on(torch.device("cuda"))
        assert autotune_on(torch.device("cuda"))
        raise RuntimeError("inside")
    assert active_options() == default and not autotune_on(torch.device("cuda"))


def test_options_must_be_kernel_options() -> None:
    with pytest.raises(TypeError, match="KernelOptions"), kernels.kernel_options({"pdl": False}):  # type: ignore[arg-type]
        pass


def _decode_chain(x: torch.Tensor, norm_w: torch.Tensor, w) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """norm -> row quantizer -> FP4 linear (split-K sum included) -> router: each reads what the one before wrote."""
    h = kernels.rms_norm(x, norm_w, 1e-6)
    hq, q = kernels.fake_quantize_nvfp4_rows(h)
    y = kernels.fp4_linear(hq, w)
    gates, ids = kernels.route_topk(y[:, :128].float(), 8, "softmax", True, torch.bfloat16)
    return h, hq, q.packed, q.scales.view(torch.uint8), y, gates, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_early_launched_chain_equals_plain_stream_order() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    norm_w = 1 + 0.1 * torch.randn(2048, device="cuda", generator=gen)
    w = torch.randn(5120, 2048, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    wq = kernels.prepare_weight(kernels.quantize_nvfp4(w, tensor_global_scale(w, 2)), w.dtype)
    with kernels.kernel_options(kernels.KernelOptions(pdl=False)):
        plain = _decode_chain(x, norm_w, wq)
    if not grid_dependency(x.device):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    for _ in range(3):  # several runs: a missing wait would show as a race, not on every run
        early = _decode_chain(x, norm_w, wq)
        torch.cuda.synchronize()
        for a, b in zip(plain, early, strict=True):
            assert torch.equal(a, b)


def test_engine_launches_its_forward_passes_with_its_options(device: str) -> None:
    """Engine(kernel_options=...) holds its options around every forward (prefill and decode steps, where the kernels
    launch) and nowhere else; an engine on the sim backend refuses them (they would change nothing)."""
    import copy

    from trace_lightning.model import Transformer
    from trace_lightning.model.model import RMSNorm
    from trace_lightning.rollout import Engine, SamplingParams

    torch.manual_seed(0)
    model = Transformer.from_name("debug-moe", n_layers=1, init_std=0.08).eval().to(device)
    options = kernels.KernelOptions(pdl=False, attention_programs_per_sm=2)
    engine = Engine(copy.deepcopy(model), "bf16", backend="triton", cuda_graph=False, kernel_options=options)
    seen = []
    final_norm = engine.model.norm  # one kernel launch a forward
    assert isinstance(final_norm, RMSNorm) and final_norm.fused is kernels.rms_norm
    final_norm.fused = lambda *args: seen.append(active_options()) or kernels.rms_norm(*args)
    engine.generate([[1, 5, 6]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(seen) == 3 and all(o is options for o in seen)  # prefill + 2 decode steps
    assert active_options() == kernels.KernelOptions()
    with pytest.raises(ValueError, match="Triton"):
        Engine(copy.deepcopy(model), "bf16", backend="sim", kernel_options=options)
