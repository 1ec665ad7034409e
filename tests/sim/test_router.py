"""sim.route_topk is the model's Router after its GEMV, bit for bit (the reference the kernel is held to)."""

import pytest
import torch

from trace_lightning import sim
from trace_lightning.model import MoEConfig
from trace_lightning.model.model import Router


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_route_topk_is_the_routers_torch_path(scoring: str, normalize: bool, dtype: torch.dtype) -> None:
    config = MoEConfig.from_name("debug-moe", router=scoring, norm_topk_prob=normalize, n_experts=60, top_k=4)
    router = Router(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=gen)
    router = router.to(dtype)
    x = torch.randn(3, 5, config.dim, generator=gen).to(dtype)
    with torch.no_grad():
        want_gates, want_ids = router(x)
        gates, ids = sim.route_topk(torch.nn.functional.linear(x, router.weight), config.top_k, scoring, normalize,
                                    dtype)
    assert gates.dtype == dtype and ids.dtype == torch.int64 and gates.shape == (3, 5, 4)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(gates, want_gates, rtol=0, atol=0)


def test_router_with_the_sim_as_its_fused_op_is_unchanged() -> None:
    """Setting Router.fused to the sim (what the engine does with fused norms on the sim backend) changes nothing."""
    router = Router(MoEConfig.from_name("debug-moe"))
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        x = torch.randn(2, 6, router.config.dim)
        want = router(x)
        router.fused = sim.route_topk
        got = router(x)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
