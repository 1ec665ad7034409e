"""tools/tiny_hf_checkpoint.py writes a checkpoint the HF path loads like a downloaded instruct one: its chat template
frames the rollouts' and the warm start's prompts alike, as transformers renders it."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

from transformers import AutoTokenizer

from trace_lightning.envs import make_env
from trace_lightning.lit.config import RolloutConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule

ROOT = Path(__file__).resolve().parents[2]


def test_the_chat_template_frames_rollout_and_warm_start_prompts(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tiny_hf_checkpoint", ROOT / "tools" / "tiny_hf_checkpoint.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.write_checkpoint(tmp_path)

    module = PolicyModule(checkpoint=str(tmp_path), rollout=RolloutConfig(prompts_per_step=2), warmup_steps=0)
    problem = make_env("arithmetic", size=10).sample(1, seed=0)[0]
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        [{"role": "user", "content": problem.prompt}], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert module.worker.encode_prompt(problem) == expected
    assert module.tokenizer.eos_id == tool.SPECIALS.index("<|im_end|>")  # responses end with the turn

    data = RLDataModule(env="arithmetic", env_kwargs={"size": 10}, demo_batch_size=2)
    data.trainer = types.SimpleNamespace(lightning_module=module)
    demo = data.demo_batch(0)
    for row, q in zip(demo.tokens.tolist(), data._problems(2, 0), strict=True):
        prompt = module.worker.encode_prompt(q)
        assert row[: len(prompt)] == prompt and prompt[-3:] == module.tokenizer.encode("nt\n")
