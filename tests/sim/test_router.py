"""sim.route_topk is a float64 router to float32 rounding, and the model's Router after its GEMV bit for bit."""

import pytest
import torch

from trace_lightning import sim
from trace_lightning.model import MoEConfig
from trace_lightning.model.model import Router


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_topk_is_the_float64_router(scoring: str, normalize: bool, dtype: torch.dtype, float64_router) -> None:
    """Against a float64 router written out in tests/conftest.py, not the model's top_k_gates that the sim wraps."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 5, 60, generator=gen) * 2).to(dtype)
    gates, ids = sim.route_topk(logits, 4, scoring, normalize, dtype)
    assert gates.dtype == dtype and ids.dtype == torch.int64 and gates.shape == ids.shape == (3, 5, 4)
    float64_router(gates, ids, logits, 4, scoring, normalize)


def test_route_topk_is_the_routers_torch_path() -> None:
    """The sim is the reference the kernel is held to bit for bit, so it must also be the model's router exactly."""
    config = MoEConfig.from_name("debug-moe", n_experts=60, top_k=4)
    router = Router(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
        x = torch.randn(3, 5, config.dim, generator=gen)
        want_gates, want_ids = router(x)
        gates, ids = sim.route_topk(torch.nn.functional.linear(x, router.weight), 4, "softmax", True, torch.float32)
    assert torch.equal(ids, want_ids) and torch.equal(gates, want_gates)


def test_router_with_the_sim_as_its_fused_op_is_unchanged() -> None:
    """Setting Router.fused to the sim (what the engine does with fused norms on the sim backend) changes nothing."""
    router = Router(MoEConfig.from_name("debug-moe"))
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        x = torch.randn(2, 6, router.config.dim, generator=torch.Generator().manual_seed(2))
        want = router(x)
        router.fused = sim.route_topk
        got = router(x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
