"""The RL DataModule: every training step asks the rollout worker for a fresh, scored batch.

The stream itself only yields step requests: Lightning prefetches one item ahead, and a rollout
generated then would come from the weights before the last sync. The request becomes a batch in
`on_before_batch_transfer`, which runs just before the training step, after the previous step's
weight sync. Rollouts are seeded by (seed, step), so a resumed run regenerates exactly the batches
the uninterrupted run would have seen. The first `warmup_steps` steps are supervised demonstration
batches from the same task generators.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from trace_lightning.envs import Env, Problem, make_env
from trace_lightning.lit.batch import DemoBatch, TrainBatch, pad_sequences, response_targets
from trace_lightning.lit.parallel import DataParallel
from trace_lightning.rollout.sampling import sequence_seeds


@dataclass(frozen=True)
class StepRequest:
    """A training step's batch, to be produced just in time."""

    step: int


class RolloutStream(IterableDataset):
    """Yields one StepRequest per training step, forever, starting at the trainer's step."""

    def __init__(self, datamodule: RLDataModule) -> None:
        self.dm = datamodule

    def __iter__(self) -> Iterator[StepRequest]:
        step = self.dm.trainer.global_step
        while True:
            yield StepRequest(step)
            step += 1


class RLDataModule(L.LightningDataModule):
    """Prompts and verifiers from an env; rollouts from the policy module's worker."""

    def __init__(
        self,
        env: str = "arithmetic",
        env_kwargs: dict[str, Any] | None = None,
        demo_batch_size: int = 64,
        eval_size: int = 64,
        seed: int = 0,
    ) -> None:
        """
        Args:
            env: Task name (trace_lightning.envs registry).
            env_kwargs: Extra arguments of the env.
            demo_batch_size: Demonstrations per supervised warm-start step.
            eval_size: Held-out problems for validation accuracy.
            seed: Seed of problem sampling (rollouts are seeded by the policy module's seed and the step).
        """
        super().__init__()
        self.env: Env = make_env(env, **(env_kwargs or {}))
        held_out = getattr(self.env, "held_out", None)
        self.eval_env: Env = held_out() if callable(held_out) else self.env
        """Where validation draws: problems training never draws, where the env can split (its held_out());
        otherwise the training env itself."""
        self.demo_batch_size, self.eval_size, self.seed = demo_batch_size, eval_size, seed

    def _problems(self, n: int, step: int) -> list[Problem]:
        return self.env.sample(n, seed=self.seed * 1_000_003 + step)

    def demo_batch(self, step: int) -> DemoBatch:
        module = self.trainer.lightning_module
        tok = module.tokenizer
        problems = module.data_parallel.share(self._problems(self.demo_batch_size, step), "data.demo_batch_size")
        prompts = [module.worker.encode_prompt(p) for p in problems]  # as the rollouts see them
        seqs = [
            p + tok.encode(self.env.demonstration(q)) + [tok.eos_id] for p, q in zip(prompts, problems, strict=True)
        ]
        tokens, mask = pad_sequences(seqs, tok.pad_id)
        targets = response_targets([len(p) for p in prompts], [len(s) for s in seqs], tokens.shape[1])
        return DemoBatch(tokens=tokens, attention_mask=mask, target_mask=targets)

    def rollout_batch(self, step: int) -> TrainBatch:
        """This rank's share of the step's prompts, whole groups, with the per-sequence seeds one process
        drawing every prompt would use: the ranks together sample exactly the one-process batch."""
        module = self.trainer.lightning_module
        dp, r = module.data_parallel, module.rollout_cfg
        problems, seeds = self.step_rollouts(module, step)
        groups = [seeds[i : i + r.group_size] for i in range(0, len(seeds), r.group_size)]
        mine = dp.share(groups, "model.rollout.prompts_per_step")
        problems = dp.share(problems, "model.rollout.prompts_per_step")
        return module.worker.rollout(self.env, problems, seed=[s for group in mine for s in group])

    def step_rollouts(self, module: Any, step: int) -> tuple[list[Problem], list[int]]:
        """The step's problems and a sampling seed for each of its rollouts (group_size a problem, consecutive), as
        one process draws them for `module` (its seed and rollout settings)."""
        r = module.rollout_cfg
        problems = self._problems(r.prompts_per_step, step)
        return problems, sequence_seeds(module.seed * 1_000_003 + step, len(problems) * r.group_size)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, StepRequest):
            return batch
        module = self.trainer.lightning_module
        if batch.step != self.trainer.global_step:
            raise RuntimeError(f"step request {batch.step} arrived at trainer step {self.trainer.global_step}")
        start = time.perf_counter()
        made = self.demo_batch(batch.step) if module.in_warmup(batch.step) else self.rollout_batch(batch.step)
        module.batch_s = time.perf_counter() - start  # the policy logs it as time/batch_s with the step's timings
        return made

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RolloutStream(self), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        problems = self.eval_env.sample(self.eval_size, seed=10**9 + self.seed)
        # Lightning's DistributedSampler splits them across ranks; an uneven split would repeat problems.
        if self.trainer is not None:
            DataParallel.of(self.trainer.strategy).share(problems, "data.eval_size")
        return DataLoader(problems, batch_size=32, collate_fn=list, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
