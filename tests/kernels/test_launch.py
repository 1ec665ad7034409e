"""Programmatic dependent launch (kernels._common.grid_dependency): when it is asked for, and that a chain of
kernels started early computes what plain stream order computes, byte for byte."""

import pytest
import torch

from trace_lightning import kernels
from trace_lightning.kernels._common import grid_dependency
from trace_lightning.quant import tensor_global_scale


def test_plain_launches_off_cuda_and_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert grid_dependency(torch.device("cpu")) == {}  # the interpreter cannot run griddepcontrol
    monkeypatch.setenv("TRACE_LIGHTNING_PDL", "0")
    assert grid_dependency(torch.device("cuda")) == {}  # decided before the device is asked


def _decode_chain(x: torch.Tensor, norm_w: torch.Tensor, w) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """norm -> row quantizer -> FP4 linear (split-K sum included) -> router: each reads what the one before wrote."""
    h = kernels.rms_norm(x, norm_w, 1e-6)
    hq, q = kernels.fake_quantize_nvfp4_rows(h)
    y = kernels.fp4_linear(hq, w)
    gates, ids = kernels.route_topk(y[:, :128].float(), 8, "softmax", True, torch.bfloat16)
    return h, hq, q.packed, q.scales.view(torch.uint8), y, gates, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["1", "2"])  # successor launched at once / at each program's exit
def test_early_launched_chain_equals_plain_stream_order(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    norm_w = 1 + 0.1 * torch.randn(2048, device="cuda", generator=gen)
    w = torch.randn(5120, 2048, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    wq = kernels.prepare_weight(kernels.quantize_nvfp4(w, tensor_global_scale(w, 2)), w.dtype)
    monkeypatch.setenv("TRACE_LIGHTNING_PDL", "0")
    plain = _decode_chain(x, norm_w, wq)
    monkeypatch.setenv("TRACE_LIGHTNING_PDL", mode)
    if not grid_dependency(x.device):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    for _ in range(3):  # several runs: a missing wait would show as a race, not on every run
        early = _decode_chain(x, norm_w, wq)
        torch.cuda.synchronize()
        for a, b in zip(plain, early, strict=True):
            assert torch.equal(a, b)
