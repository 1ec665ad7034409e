"""The RL DataModule: every training step asks the rollout worker for a fresh, scored batch.

The stream itself only yields step requests: Lightning prefetches one item ahead, and a rollout
generated then would come from the weights before the last sync. The request becomes a batch in
`on_before_batch_transfer`, which runs just before the training step, after the previous step's
weight sync. Rollouts are seeded by (seed, step), so a resumed run regenerates exactly the batches
the uninterrupted run would have seen. The first `warmup_steps` steps are supervised demonstration
batches from the same task generators.

A step's problems depend on nothing but (seed, step), so with `problem_workers` the loader's worker processes build
them ahead and the request carries them: a procedurally generated task (countdown: ~2.5-5 ms a problem in
reasoning-gym, 256 of them a warm-start step) then costs the training process nothing.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trace_lightning.envs import Env, Problem, make_env
from trace_lightning.lit.batch import DemoBatch, TrainBatch, pad_sequences, response_targets
from trace_lightning.lit.parallel import DataParallel
from trace_lightning.rollout.sampling import sequence_seeds


@dataclass(frozen=True)
class StepRequest:
    """A training step's batch, to be produced just in time."""

    step: int
    problems: list[Problem] | None = None
    """The step's problems (every rank's), built ahead by a loader worker; None: built when the batch is made."""


class RolloutStream(IterableDataset):
    """Yields one StepRequest per training step, forever, starting at the trainer's step."""

    def __init__(self, datamodule: RLDataModule) -> None:
        self.dm = datamodule

    def __iter__(self) -> Iterator[StepRequest]:
        # loader workers take every n-th step each; the loader reads them round-robin, so steps stay in order
        worker = get_worker_info()
        offset, stride = (0, 1) if worker is None else (worker.id, worker.num_workers)
        step = self.dm.trainer.global_step + offset
        while True:
            yield StepRequest(step, self.dm.step_problems(step) if worker is not None else None)
            step += stride


def _leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """A loader worker ignores SIGINT and SIGTERM. A Ctrl-C, or a scheduler's SIGTERM, reaches the whole process
    group: the training process then stops after its step with a checkpoint (StopOnSignal) and shuts its workers down
    itself, where a worker killed first would have failed the fit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class RLDataModule(L.LightningDataModule):
    """Prompts and verifiers from an env; rollouts from the policy module's worker."""

    def __init__(
        self,
        env: str = "arithmetic",
        env_kwargs: dict[str, Any] | None = None,
        demo_batch_size: int = 64,
        eval_size: int = 64,
        seed: int = 0,
        problem_workers: int = 0,
    ) -> None:
        """
        Args:
            env: Task name (trace_lightning.envs registry).
            env_kwargs: Extra arguments of the env.
            demo_batch_size: Demonstrations per supervised warm-start step.
            eval_size: Held-out problems for validation accuracy.
            seed: Seed of problem sampling (rollouts are seeded by the policy module's seed and the step).
            problem_workers: Loader worker processes building the next steps' problems while this one trains (0:
                each step builds its own, in the training process).
        """
        super().__init__()
        self.env: Env = make_env(env, **(env_kwargs or {}))
        held_out = getattr(self.env, "held_out", None)
        self.eval_env: Env = held_out() if callable(held_out) else self.env
        """Where validation draws: problems training never draws, where the env can split (its held_out());
        otherwise the training env itself."""
        self.demo_batch_size, self.eval_size, self.seed = demo_batch_size, eval_size, seed
        if isinstance(problem_workers, bool) or not isinstance(problem_workers, int) or problem_workers < 0:
            raise ValueError(f"data.problem_workers must be an integer >= 0, got {problem_workers!r}")
        self.problem_workers = problem_workers

    def _problems(self, n: int, step: int) -> list[Problem]:
        return self.env.sample(n, seed=self.seed * 1_000_003 + step)

    def step_problems(self, step: int) -> list[Problem]:
        """Every rank's problems of a step: demonstrations in the warm start, then the rollouts' prompts."""
        module = self.trainer.lightning_module
        rollout = not module.in_warmup(step)
        return self._problems(module.rollout_cfg.prompts_per_step if rollout else self.demo_batch_size, step)

    def demo_batch(self, step: int, problems: list[Problem] | None = None) -> DemoBatch:
        """This rank's share of the step's demonstrations (`problems`: the step's, if already built)."""
        module = self.trainer.lightning_module
        tok = module.tokenizer
        problems = self._problems(self.demo_batch_size, step) if problems is None else problems
        problems = module.data_parallel.share(problems, "data.demo_batch_size")
        prompts = [module.worker.encode_prompt(p) for p in problems]  # as the rollouts see them
        seqs = [
            p + tok.encode(self.env.demonstration(q)) + [tok.eos_id] for p, q in zip(prompts, problems, strict=True)
        ]
        tokens, mask = pad_sequences(seqs, tok.pad_id)
        targets = response_targets([len(p) for p in prompts], [len(s) for s in seqs], tokens.shape[1])
        return DemoBatch(tokens=tokens, attention_mask=mask, target_mask=targets)

    def rollout_batch(self, step: int, problems: list[Problem] | None = None) -> TrainBatch:
        """This rank's share of the step's prompts, whole groups, with the per-sequence seeds one process
        drawing every prompt would use: the ranks together sample exactly the one-process batch (`problems`: the
        step's, if already built)."""
        module = self.trainer.lightning_module
        dp, r = module.data_parallel, module.rollout_cfg
        problems, seeds = self.step_rollouts(module, step, problems)
        groups = [seeds[i : i + r.group_size] for i in range(0, len(seeds), r.group_size)]
        mine = dp.share(groups, "model.rollout.prompts_per_step")
        problems = dp.share(problems, "model.rollout.prompts_per_step")
        return module.worker.rollout(self.env, problems, seed=[s for group in mine for s in group])

    def step_rollouts(self, module: Any, step: int,
                      problems: list[Problem] | None = None) -> tuple[list[Problem], list[int]]:
        """The step's problems (built here unless given) and a sampling seed for each of its rollouts (group_size a
        problem, consecutive), as one process draws them for `module` (its seed and rollout settings)."""
        r = module.rollout_cfg
        problems = self._problems(r.prompts_per_step, step) if problems is None else problems
        return problems, sequence_seeds(module.seed * 1_000_003 + step, len(problems) * r.group_size)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, StepRequest):
            return batch
        module = self.trainer.lightning_module
        if batch.step != self.trainer.global_step:
            raise RuntimeError(f"step request {batch.step} arrived at trainer step {self.trainer.global_step}")
        start = time.perf_counter()
        make = self.demo_batch if module.in_warmup(batch.step) else self.rollout_batch
        made = make(batch.step, batch.problems)
        module.batch_s = time.perf_counter() - start  # the policy logs it as time/batch_s with the step's timings
        return made

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RolloutStream(self), batch_size=None, num_workers=self.problem_workers,
                          worker_init_fn=_leave_stop_signals_to_the_trainer)

    def val_dataloader(self) -> DataLoader:
        problems = self.eval_env.sample(self.eval_size, seed=10**9 + self.seed)
        # Lightning's DistributedSampler splits them across ranks; an uneven split would repeat problems.
        if self.trainer is not None:
            DataParallel.of(self.trainer.strategy).share(problems, "data.eval_size")
        return DataLoader(problems, batch_size=32, collate_fn=list, num_workers=0)

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
