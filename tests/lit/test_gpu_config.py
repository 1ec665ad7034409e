"""conf/gpu.yaml stacks on conf/sim.yaml into a one-GPU TRACE run (parsed only: CI has no GPU)."""

from pathlib import Path

from trace_lightning.lit.cli import main

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_gpu_config_stacks_on_sim() -> None:
    parser = main(["--config", str(CONF / "sim.yaml")], run=False).parser
    ns = parser.parse_args(["--config", str(CONF / "sim.yaml"), "--config", str(CONF / "gpu.yaml")])
    assert ns.trainer.accelerator == "gpu" and ns.trainer.devices == 1
    assert ns.model.model == "small-moe" and ns.data.env == "countdown" and ns.data.problem_workers == 4
    assert ns.model.trace.method == "trace_compact" and ns.model.trace.backend == "auto"
    assert ns.model.rollout.prompts_per_step * ns.model.rollout.group_size == 512
    callbacks = [c.class_path.rsplit(".", 1)[-1] for c in ns.trainer.callbacks]
    assert callbacks[:4] == ["WeightSync", "CacheExchange", "DepthSelectiveCompaction", "MismatchMonitor"]
    assert ns.trainer.callbacks[0].init_args.audit_every > 0  # the weight audit stays on
    assert ns.trainer.callbacks[3].init_args.bf16_reference_every == 10
    assert ns.trainer.logger.class_path.endswith("RunLogger")


def test_long_gpu_config_stacks_on_gpu_with_long_responses_and_micro_batches() -> None:
    """conf/gpu_long.yaml: the long-response fit (medium-moe, 256 x 1024-token responses, micro-batched)."""
    parser = main(["--config", str(CONF / "sim.yaml")], run=False).parser
    ns = parser.parse_args([arg for name in ("sim.yaml", "gpu.yaml", "gpu_long.yaml")
                            for arg in ("--config", str(CONF / name))])
    assert ns.trainer.accelerator == "gpu" and ns.model.model == "medium-moe" and ns.data.env == "countdown"
    rollout = ns.model.rollout
    assert rollout.prompts_per_step * rollout.group_size == 256
    assert rollout.min_new_tokens == rollout.max_new_tokens == 1024
    assert ns.model.micro_batch_size == 4 and ns.model.train_compute == "bf16" and ns.model.trace.backend == "auto"
    assert ns.trainer.callbacks[3].init_args.bf16_reference_every == 50
