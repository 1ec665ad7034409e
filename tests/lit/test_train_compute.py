"""`train_compute: bf16`: the training forward under bf16 autocast, master weights and gradients in fp32."""

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from trace_lightning.guidance import FakeQuantHook
from trace_lightning.lit.batch import TrainBatch
from trace_lightning.lit.callbacks import default_callbacks
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.model import model as model_module
from trace_lightning.rl.logprobs import token_logprobs


def _module(method: str = "fp4_qat", train_compute: str = "bf16") -> PolicyModule:
    return PolicyModule(trace=TraceConfig(method=method), rollout=RolloutConfig(prompts_per_step=2, group_size=2,
                        max_new_tokens=3), cpu_threads=1, train_compute=train_compute)


def test_unknown_train_compute_is_named() -> None:
    with pytest.raises(ValueError, match="unknown train_compute 'fp16'"):
        _module(train_compute="fp16")


def test_trace_exact_refuses_bf16_training_compute() -> None:
    with pytest.raises(ValueError, match="trace_exact.*rollout_compute"):
        _module("trace_exact")


class DtypeSpy(FakeQuantHook):
    """fp4_qat's hook, noting the dtype of every activation it rounds."""

    def __init__(self) -> None:
        super().__init__("nvfp4")
        self.dtypes: set[torch.dtype] = set()

    def activation(self, x: torch.Tensor, *, layer: int, site: str) -> torch.Tensor:
        self.dtypes.add(x.dtype)
        return super().activation(x, layer=layer, site=site)


def _batch(module: PolicyModule) -> TrainBatch:
    torch.manual_seed(1)
    tokens = torch.randint(3, module.policy.config.vocab_size, (2, 12))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    return TrainBatch(tokens=tokens, attention_mask=mask, response_mask=mask[:, 1:], rewards=torch.zeros(2),
                      rollout_logprobs=torch.zeros(2, 11), group_size=2, policy_version=0)


@pytest.mark.parametrize("train_compute", ["fp32", "bf16"])
def test_training_forward_computes_in_train_compute(train_compute: str) -> None:
    module = _module(train_compute=train_compute)
    batch, hook = _batch(module), DtypeSpy()
    logprobs, _ = module.training_forward(batch, hook)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=train_compute == "bf16"):
        manual = module.policy(batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1], hook=DtypeSpy())
    expected = token_logprobs(manual.float(), batch.tokens[:, 1:], module.rollout_cfg.temperature)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=0)
    if train_compute == "bf16":
        assert torch.bfloat16 in hook.dtypes  # projections' outputs (the residual stream's norms stay fp32)
    else:
        assert hook.dtypes == {torch.float32}
    logprobs.sum().backward()
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)  # master weights and their gradients stay fp32


def test_grouped_experts_keep_the_grouped_gemm_under_autocast(monkeypatch: Any) -> None:
    calls: list[torch.dtype] = []
    grouped_mm = torch._grouped_mm

    def counted(x: torch.Tensor, w: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append(x.dtype)
        return grouped_mm(x, w, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    x, w = torch.randn(6, 16), torch.randn(3, 8, 16)
    counts = torch.tensor([2, 0, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model_module.grouped_linear(x, w, counts)
    assert calls == [torch.bfloat16] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1),
                                               offs=counts.cumsum(0).to(torch.int32)), rtol=0, atol=0)


def test_a_guided_fit_trains_in_bf16(tmp_path: Path) -> None:
    module = PolicyModule(trace=TraceConfig(method="trace_compact"), warmup_steps=2, cpu_threads=1,
                          rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=3),
                          train_compute="bf16", micro_batch_size=2)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", max_steps=4, callbacks=default_callbacks(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=RLDataModule(env="arithmetic", demo_batch_size=4, eval_size=4))
    assert trainer.global_step == 4
    after = module.policy.state_dict()
    assert all(after[k].dtype == v.dtype for k, v in before.items())  # fp32 master weights stay fp32
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    assert "trace_compact" in repr(module.hparams["trace"]) and module.hparams["train_compute"] == "bf16"
