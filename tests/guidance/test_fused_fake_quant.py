"""A training micro-step through the fused fake-quant kernels (as it runs on a GPU; here under Triton's interpreter)
gives the reference path's logits and every parameter gradient bit for bit: guided by parity records (trace_compact)
and plain (fp4_qat), weights through the step cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from trace_lightning.guidance import FakeQuantHook, GuidedHook, collate_records
from trace_lightning.model import QuantHook, Transformer
from trace_lightning.quant import FakeQuantCache
from trace_lightning.quant import fake as fake_module

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter

LENGTHS = [9, 14, 11]


def _micro_step(model: Transformer, tokens: Tensor, mask: Tensor, hook: QuantHook, routed: Tensor | None,
                fused: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Tensor, dict[str, Tensor]]:
    calls = {"fused": 0}
    import trace_lightning.kernels.fake_quant as kernel_module

    real = kernel_module.fused_fake_quantized

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["fused"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fake_module, "_fused_wanted", lambda x: fused)
    monkeypatch.setattr(kernel_module, "fused_fake_quantized", counting)
    model.zero_grad(set_to_none=True)
    logits = model(tokens, attention_mask=mask, hook=hook, routed=routed)
    logits.float().log_softmax(-1)[mask].logsumexp(-1).mean().backward()
    assert (calls["fused"] > 0) == fused
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["trace_compact", "fp4_qat"])
def test_fused_micro_step_equals_the_reference(debug_model, make_records, batch_of, method: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seqs, tokens, mask = batch_of(LENGTHS)
    guide = collate_records([r.compact("parity") for r in make_records(debug_model, seqs, "nvfp4")], tokens.shape[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run on CPU tensors only when interpreted
    model, guide = copy.deepcopy(debug_model).to(device), guide.to(device)
    tokens, mask = tokens.to(device), mask.to(device)
    results = []
    for fused in (False, True):
        weights = FakeQuantCache()
        hook = (GuidedHook("nvfp4", guide, "parity", mask, weights=weights) if method == "trace_compact"
                else FakeQuantHook("nvfp4", valid_mask=mask, weights=weights))
        routed = guide.routes_for_replay() if method == "trace_compact" else None
        results.append(_micro_step(model, tokens, mask, hook, routed, fused, monkeypatch))
    (ref_logits, ref_grads), (logits, grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)
