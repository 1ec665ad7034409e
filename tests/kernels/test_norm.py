"""Triton rms_norm against the model's RMSNorm (through its sim twin): same values, float32 sum order aside."""

import pytest
import torch

from trace_lightning import kernels, sim
from trace_lightning.model.model import Attention, RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 2048), (4, 8, 128), (5, 96)])
def test_rms_norm_matches_the_model(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
    norm = norm.to(dtype)
    expected = norm(x)
    torch.testing.assert_close(sim.rms_norm(x, norm.weight, 1e-6), expected, rtol=0, atol=0)
    got = kernels.rms_norm(x.to(device), norm.weight.detach().to(device), 1e-6).cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # only the float32 sum order differs: a last-bit difference of the mean, rarely visible after the cast
    same = (got == expected).float().mean().item()
    assert same >= (0.99 if dtype == torch.bfloat16 else 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)


def test_rms_norm_rejects_a_weight_of_the_wrong_width(device: str) -> None:
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(torch.ones(2, 64, device=device), torch.ones(32, device=device), 1e-6)


def test_engine_runs_its_norms_through_the_kernel(device: str) -> None:
    """A bf16 engine on the Triton backend sets every RMSNorm to the one-launch kernel (and the q / k norm + RoPE to
    kernels.rope) and samples what the sim backend's engine (the model's own ops) samples; on CPU bit for bit (the
    kernels round bf16 like torch)."""
    import copy

    from trace_lightning.model import Transformer
    from trace_lightning.rollout import Engine, SamplingParams

    torch.manual_seed(0)
    model = Transformer.from_name("debug-moe", n_layers=2, init_std=0.08).eval().to(device)
    prompts = [[1, 5, 6, 7], [1, 9, 3]]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    fused = Engine(copy.deepcopy(model), "bf16", backend="triton", cuda_graph=False)
    plain = Engine(copy.deepcopy(model), "bf16", backend="sim")
    norms = [m for m in fused.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.fused is kernels.rms_norm for m in norms)
    assert all(m.fused is None for m in plain.model.modules() if isinstance(m, RMSNorm))
    attention = [m for m in fused.model.modules() if isinstance(m, Attention)]
    assert attention and all(m.fused_rope is kernels.rope for m in attention)  # q / k norm + RoPE in one launch
    assert all(m.fused_rope is None for m in plain.model.modules() if isinstance(m, Attention))
    calls = {"norm": 0, "rope": 0}

    def counted(f, kind: str):  # noqa: ANN001, ANN202
        return lambda *args: calls.__setitem__(kind, calls[kind] + 1) or f(*args)

    for m in norms:  # count the kernels' calls: generate runs without autograd, so each module takes its kernel
        m.fused = counted(m.fused, "norm")
    for m in attention:
        m.fused_rope = counted(m.fused_rope, "rope")
    a, b = fused.generate(prompts, params), plain.generate(prompts, params)
    # prefill + 3 decode steps; the q / k norms run inside the rope kernel
    assert calls["norm"] >= (len(norms) - 2 * len(attention)) * 4 and calls["rope"] >= 2 * len(attention) * 4
    assert a.responses == b.responses
    if device == "cpu":
        assert a.logprobs == b.logprobs
    else:  # CUDA's torch reduces the mean of squares in another order: rare last-bit differences
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0.05)


def test_a_fused_norm_leaves_training_to_the_autograd_path(device: str) -> None:
    """The kernel has no backward: with gradients on, RMSNorm computes with torch ops even when fused is set."""
    norm = RMSNorm(64, 1e-6).to(device)
    norm.fused = kernels.rms_norm
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).to(device).requires_grad_()
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(norm(x), sim.rms_norm(x, norm.weight, 1e-6), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_norm_is_the_written_out_arithmetic_gradients_included(dtype: torch.dtype) -> None:
    """RMSNorm's autograd path (torch's rms_norm: one kernel each way on CUDA) against the arithmetic written out with
    torch ops (sim.rms_norm, differentiated by autograd): on the CPU the same bits, forward and both gradients."""
    gen = torch.Generator().manual_seed(5)
    x0, grad = (torch.randn(4, 8, 128, generator=gen) * 3).to(dtype), torch.randn(4, 8, 128, generator=gen)
    norm = RMSNorm(128, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(128, generator=gen))
    weight = norm.weight.detach().clone().requires_grad_()
    x, x_ref = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    expected = sim.rms_norm(x_ref, weight, 1e-6)
    got = norm(x)
    (got.float() * grad).sum().backward()
    (expected.float() * grad).sum().backward()
    assert got.dtype == expected.dtype
    for a, b in ((got, expected), (x.grad, x_ref.grad), (norm.weight.grad, weight.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
