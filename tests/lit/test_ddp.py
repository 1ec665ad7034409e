"""Data-parallel RL on CPU (gloo): two ranks with B/2 prompts each compute the one-rank step with B prompts.

Same seeds, fp32 training: the ranks' rollouts together are the one-rank rollouts row for row (bit-exact),
and the loss, the all-reduced gradients and rank 0's logged reward/mismatch equal the one-rank values up to
fp32 summation order (tolerance derived below). Also a 2-process `trace-rl fit` of conf/sim.yaml.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.tensor import DTensor

from trace_lightning.envs import ENVS, Problem, make_env, register_env
from trace_lightning.lit.batch import DemoBatch, TrainBatch
from trace_lightning.lit.callbacks import CacheExchange, DepthSelectiveCompaction, MismatchMonitor, WeightSync
from trace_lightning.lit.cli import main
from trace_lightning.lit.config import RolloutConfig, TraceConfig
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.parallel import DataParallel, loss_denominators, loss_scale
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.tensorboard import tensorboard_tags
from trace_lightning.rl.losses import AGG_MODES, agg_loss

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2  # a supervised step and an RL step at FROZEN_LR (the weights stay), then an evaluation
U = 2.0**-24  # fp32 unit roundoff
TOL = 128 * U
"""Both runs compute the same sums in another order (rows split across ranks, GEMMs of other shapes, the
all-reduce adding the ranks' halves). A length-n fp32 sum's relative error is bounded by about n*u (Higham's
gamma_n) and is typically sqrt(n)*u; every sum on the path is over at most n = 128 terms (model width 128,
8 rows x <= 12 tokens), so n*u = 128u ~ 7.6e-6 bounds the relative difference of the loss, of the gradient
(in global norm) and of token-mean metrics. Measured: ~3u. The bugs this guards against are far above it:
a per-rank token mean instead of the global one is off by ~1e-3 here, unsharded seeds change the samples."""
FROZEN_LR = 1e-30
"""A learning rate that leaves the weights bit-identical: AdamW moves a weight by at most about lr, far below half
an ulp of any weight above ~1e-22 (the runs check their engines' FP4 checksums are the same at the end)."""
MISMATCH = ("mismatch/k3_kl", "mismatch/logprob_abs_diff", "mismatch/prob_abs_diff", "mismatch/token_mult_prob_error",
            "mismatch/is_ratio_min", "mismatch/is_ratio_mean", "mismatch/is_ratio_max", "mismatch/ess")
MISMATCH_TAGS = tuple(tensorboard_tags(dict.fromkeys(MISMATCH, 1.0)))  # what the loggers receive (lit.tensorboard)
TIMING = ("rollout/tokens_per_s", "time/rollout_s", "time/sync_s", "guidance/capture_ms")


class DigitsEnv:
    """Arithmetic prompts with a graded reward (the fraction of digits in the response; an empty response scores
    1 when the answer is negative), so that a barely trained policy's groups already differ in reward (the RL
    step has non-zero advantages) and its greedy evaluation, which stops at once, is neither 0 nor 1."""

    def __init__(self) -> None:
        self.arithmetic = make_env("arithmetic")

    def sample(self, n: int, seed: int) -> list[Problem]:
        return self.arithmetic.sample(n, seed)

    def score(self, problem: Problem, response: str) -> float:
        if not response:
            return float(problem.answer.startswith("-"))
        return sum(c.isdigit() for c in response) / len(response)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer


if "digits" not in ENVS:
    register_env("digits")(DigitsEnv)


class MemoryLogger(Logger):
    """Keeps what Lightning hands the loggers, on every rank (not rank_zero_only, unlike a real logger): each rank's
    record shows what that rank would write, so the test can compare ranks instead of trusting a decorator."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are not what these tests compare: nothing to keep."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.steps.setdefault(int(step or 0), {}).update({k: float(v) for k, v in metrics.items() if k != "epoch"})


class StepProbe(L.Callback):
    """Per step: the batch rows this rank trained on, its loss, and the gradients the optimizer sees; the prompts it
    evaluated; its engine's FP4 checksums when training starts (after the first sync) and ends."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps, self.evaluated = out, [], []
        self.engine_at_start: dict[str, str] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if self.engine_at_start is None:
            self.engine_at_start = module.worker.weight_checksums()

    def on_validation_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self.evaluated.extend(problem.prompt for problem in batch)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rows = batch.target_mask.sum(-1) if isinstance(batch, DemoBatch) else batch.response_mask.sum(-1)
        self.steps[-1].update(loss=outputs["loss"].detach().clone(), tokens=_rows(batch), row_targets=rows)
        if isinstance(batch, TrainBatch):
            self.steps[-1].update(rewards=batch.rewards.clone(), rollout_logprobs=_rows(batch, "rollout_logprobs"))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: Any, optimizer: Any) -> None:
        grads = {n: _full(p.grad).detach().clone() for n, p in module.policy.named_parameters() if p.grad is not None}
        self.steps.append({"grads": grads})

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        record = {"steps": self.steps, "logged": trainer.loggers[0].steps, "evaluated": self.evaluated,
                  "engine_at_start": self.engine_at_start, "engine": module.worker.weight_checksums()}
        torch.save(record, self.out / f"rank{trainer.global_rank}.pt")


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one full tensor (FSDP's are sharded DTensors: every rank gathers them)."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _rows(batch: TrainBatch | DemoBatch, field: str = "tokens") -> list[torch.Tensor]:
    """Each row without its right padding (ranks pad to their own widths)."""
    values = getattr(batch, field)
    lengths = batch.attention_mask.sum(-1) - (0 if field == "tokens" else 1)
    return [v[: int(n)].clone() for v, n in zip(values, lengths, strict=True)]


def _trainer(devices: int, max_steps: int, callbacks: list[L.Callback], logger: Logger | bool,
             strategy: Any = None, validate: bool = False) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or ("ddp_fork" if devices > 1 else "auto"),
        max_steps=max_steps,
        # The test's callbacks first (they see each step before the weight sync); every sync audited.
        callbacks=[*callbacks, WeightSync(audit_every=1), CacheExchange(), DepthSelectiveCompaction(),
                   MismatchMonitor()],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1 if validate else 0,  # one batch of 16 problems (8 per rank), after the last step
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )


def _module(warmup_steps: int, warmup_lr: float, init_from: str | None = None,
            method: str = "trace_compact", lr: float = 1e-3) -> PolicyModule:
    return PolicyModule(
        trace=TraceConfig(method=method, audit_every=1),
        rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=3),
                warmup_steps=warmup_steps,
        warmup_lr=warmup_lr,
        lr=lr,
        init_from=init_from,
        cpu_threads=1,
    )


def _data() -> RLDataModule:
    return RLDataModule(env="digits", demo_batch_size=8, eval_size=16)


def _warm_start(path: Path) -> str:
    """Two supervised steps at a high rate: the policy now stops early at times, so responses differ in length."""
    trainer = _trainer(1, 2, [], logger=False)
    trainer.fit(_module(warmup_steps=2, warmup_lr=0.05), datamodule=_data())
    trainer.save_checkpoint(path)
    return str(path)


def _fit(out: Path, devices: int, init_from: str, method: str = "trace_compact") -> None:
    """A supervised step and an RL step at FROZEN_LR (their losses and gradients compared; the weights stay, so
    the ranks' engines and the one-rank engine still hold the same weights), then an evaluation."""
    trainer = _trainer(devices, STEPS, [StepProbe(out)], logger=MemoryLogger(), validate=True)
    module = _module(warmup_steps=1, warmup_lr=FROZEN_LR, lr=FROZEN_LR, init_from=init_from, method=method)
    trainer.fit(module, datamodule=_data())


def _fsdp_rank(rank: int, out: Path, init_from: str, method: str, port: int) -> None:
    """One FSDP2 rank, started by the test (Lightning's launcher would re-run pytest)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = _trainer(2, STEPS, [StepProbe(out)], logger=MemoryLogger(), strategy=strategy, validate=True)
    module = _module(warmup_steps=1, warmup_lr=FROZEN_LR, lr=FROZEN_LR, init_from=init_from, method=method)
    trainer.fit(module, datamodule=_data())


def _fit_fsdp(out: Path, init_from: str, method: str) -> None:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [multiprocessing.get_context("fork").Process(target=_fsdp_rank, args=(r, out, init_from, method, port))
             for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0, 0]


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Any:
    """The ranks here are forked, and libgomp is not fork-safe: a child that enters an OpenMP parallel region the
    parent's thread pool served waits forever (seen: both FSDP ranks stuck in load_state_dict after earlier fits in
    the same process). One intra-op thread runs every region inline; the parent's count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _warm_start(tmp_path_factory.mktemp("warm") / "warm.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, warm: str) -> dict[str, Any]:
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    _fit(one, 1, warm)
    _fit(two, 2, warm)
    return {"one": _load(one / "rank0.pt"), "ranks": [_load(two / f"rank{r}.pt") for r in range(2)]}


def _eval_logged(logged: dict[int, dict[str, float]]) -> dict[str, float]:
    return next(metrics for metrics in logged.values() if "eval/accuracy" in metrics)


def _global_norm(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads.values()))


@pytest.mark.parametrize("step", range(STEPS))
def test_ranks_roll_out_the_one_rank_batch_in_whole_groups(runs: dict[str, Any], step: int) -> None:
    one, ranks = runs["one"]["steps"][step], [r["steps"][step] for r in runs["ranks"]]
    both = [row for r in ranks for row in r["tokens"]]
    assert len(both) == len(one["tokens"]) == 8
    assert all(torch.equal(a, b) for a, b in zip(both, one["tokens"], strict=True))  # rank r holds rows 4r..4r+3
    counts = [int(r["row_targets"].sum()) for r in ranks]
    assert counts[0] != counts[1], "the fixture should give the ranks different token counts"
    if "rewards" in one:
        assert torch.equal(torch.cat([r["rewards"] for r in ranks]), one["rewards"])
        assert one["rewards"].unique().numel() > 1, "the fixture should give non-zero advantages"
        lps = [row for r in ranks for row in r["rollout_logprobs"]]
        assert all(torch.equal(a, b) for a, b in zip(lps, one["rollout_logprobs"], strict=True))


@pytest.mark.parametrize("step", range(STEPS))
def test_loss_and_all_reduced_gradients_equal_one_rank(runs: dict[str, Any], step: int) -> None:
    one, ranks = runs["one"]["steps"][step], [r["steps"][step] for r in runs["ranks"]]
    # Each rank's loss is its share of the global loss; DDP averages the ranks' gradients.
    shares = float(ranks[0]["loss"] + ranks[1]["loss"]) / 2
    assert shares == pytest.approx(float(one["loss"]), rel=TOL, abs=0)
    assert ranks[0]["grads"].keys() == ranks[1]["grads"].keys() == one["grads"].keys()
    for name, grad in ranks[0]["grads"].items():
        assert torch.equal(grad, ranks[1]["grads"][name]), name  # one all-reduce: identical on every rank
    diff = {name: grad - one["grads"][name] for name, grad in ranks[0]["grads"].items()}
    assert _global_norm(diff) <= TOL * _global_norm(one["grads"])


@pytest.mark.parametrize("step", range(STEPS))
def test_rank_zero_logs_loss_reward_and_mismatch_over_all_samples(runs: dict[str, Any], step: int) -> None:
    """Relative tolerance only: the mismatch metrics are ~1e-5, so an absolute TOL (7.6e-6) would pass half of
    their value. Every rank is handed the same global values (sync_dist), so whichever rank's logger writes, it
    writes the one-rank numbers."""
    one, two = runs["one"]["logged"][step], runs["ranks"][0]["logged"][step]
    other_rank = runs["ranks"][1]["logged"][step]
    assert one.keys() == two.keys() == other_rank.keys()
    keys = ("train/sft_loss",) if step == 0 else ("train/loss", "reward/mean", *MISMATCH_TAGS)
    for key in keys:
        assert one[key] != 0.0 or key.endswith("is_ratio_min") or key.endswith("k3_kl"), key
        assert two[key] == pytest.approx(one[key], rel=TOL, abs=0), key
        assert other_rank[key] == two[key], key


@pytest.mark.parametrize("agg_mode", sorted(AGG_MODES))
def test_loss_scale_makes_the_rank_mean_the_global_aggregate(agg_mode: str) -> None:
    """Two ranks' batches of other widths and token counts: the mean of the scaled rank losses (what DDP's
    gradient averaging differentiates) is the aggregate over the concatenated batch, in every agg mode."""
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(3, 5, generator=gen) < 0.7, torch.rand(3, 8, generator=gen) < 0.4]
    masks[1][2] = False  # a row without response tokens
    losses = [torch.randn(m.shape, generator=gen, dtype=torch.float64) for m in masks]
    width = max(m.shape[1] for m in masks)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    expected = agg_loss(torch.cat([pad(x) for x in losses]), torch.cat([pad(m) for m in masks]), agg_mode)

    def reduce(value: torch.Tensor, op: str) -> torch.Tensor:  # the two ranks' denominators, summed or maxed
        both = torch.stack([loss_denominators(m)[-value.numel():] for m in masks])
        return both.sum(0) if op == "sum" else both.amax(0)

    shares = [agg_loss(x, m, agg_mode) * loss_scale(m, agg_mode, DataParallel(r, 2), reduce).double()
              for r, (x, m) in enumerate(zip(losses, masks, strict=True))]
    assert float(sum(shares) / 2) == pytest.approx(float(expected), rel=1e-6)
    assert float(loss_scale(masks[0], agg_mode, DataParallel(), reduce)) == 1.0


def test_prompts_split_in_whole_shares_or_fail_naming_the_setting() -> None:
    assert DataParallel(1, 2).share(list("abcd"), "x") == ["c", "d"]
    with pytest.raises(ValueError, match=r"model.rollout.prompts_per_step=5 does not split evenly across 2"):
        DataParallel(0, 2).share(list("abcde"), "model.rollout.prompts_per_step")


@pytest.mark.slow  # a whole run or many processes: CI runs it in its slow pass
def test_two_process_fit_of_the_sim_config(tmp_path: Path) -> None:
    """`trace-rl fit` of conf/sim.yaml on two gloo ranks: one event file (rank 0), finite metrics, eval gathered."""
    args = ["--config", str(ROOT / "conf/sim.yaml"), "--config", str(ROOT / "conf/ddp.yaml"),
            "--trainer.max_steps", "3", "--model.warmup_steps", "1", "--trainer.val_check_interval", "3",
            "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
            "--model.rollout.prompts_per_step", "4", "--model.rollout.group_size", "4",
            "--data.demo_batch_size", "8", "--data.eval_size", "8"]
    launched = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")  # earlier fits' env
    env = {**{k: v for k, v in os.environ.items() if k not in launched}, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "trace_lightning.lit.cli", "fit", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = sorted((tmp_path / "runs").rglob("events.out.tfevents.*"))
    events = [e for e in found if e.parent.name != "bf16_reference"]  # the BF16 reference is a sub-run of rank 0's
    assert len(events) == 1 and len(found) == 2, found
    scalars = EventAccumulator(str(events[0])).Reload()
    for key in ("train/sft_loss", "train/loss", "reward/mean", "mismatch/k3_kl", "eval/accuracy"):
        values = [e.value for e in scalars.Scalars(key)]
        assert values and all(math.isfinite(v) for v in values), key
    assert 0.0 <= scalars.Scalars("eval/accuracy")[-1].value <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["trace_compact", "fp4_qat"])
def test_fsdp_ranks_compute_the_one_rank_step(tmp_path: Path, warm: str, runs: dict[str, Any], method: str) -> None:
    """FSDP2 (ModelParallelStrategy, gloo) over two ranks: the engines, synced by the bucketed gather, sample the
    one-rank rows; the guided (trace_compact) or QAT training forward on sharded blocks gives the one-rank loss
    and gradients."""
    if method == "trace_compact":
        one = runs["one"]
    else:
        (tmp_path / "one").mkdir()
        _fit(tmp_path / "one", 1, warm, method)
        one = _load(tmp_path / "one" / "rank0.pt")
    _fit_fsdp(tmp_path, warm, method)
    ranks = [_load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for step in range(STEPS):
        mine = [r["steps"][step] for r in ranks]
        both = [row for r in mine for row in r["tokens"]]
        assert all(torch.equal(a, b) for a, b in zip(both, one["steps"][step]["tokens"], strict=True))
        shares = float(mine[0]["loss"] + mine[1]["loss"]) / 2
        assert shares == pytest.approx(float(one["steps"][step]["loss"]), rel=TOL, abs=0)
        expected = one["steps"][step]["grads"]
        assert mine[0]["grads"].keys() == expected.keys()
        diff = {name: grad - expected[name] for name, grad in mine[0]["grads"].items()}
        assert _global_norm(diff) <= TOL * _global_norm(expected)
    for key in ("train/loss", "reward/mean", *MISMATCH_TAGS):
        assert ranks[0]["logged"][1][key] == pytest.approx(one["logged"][1][key], rel=TOL, abs=0), key
    accuracy = _eval_logged(ranks[0]["logged"])["eval/accuracy"]
    assert accuracy == pytest.approx(_eval_logged(one["logged"])["eval/accuracy"], rel=TOL, abs=0)


@pytest.mark.parametrize(("config", "strategy"), [("ddp", DDPStrategy), ("fsdp", ModelParallelStrategy)])
def test_scaling_configs_stack_on_sim(config: str, strategy: type) -> None:
    cli = main(["--config", str(ROOT / "conf/sim.yaml"), "--config", str(ROOT / f"conf/{config}.yaml")], run=False)
    assert isinstance(cli.trainer.strategy, strategy)
    assert cli.trainer.num_devices == 2
    assert cli.model.method.name == "trace_compact"


class DivergeRankOne(L.Callback):
    """After the optimizer step, rank 1's master weights drift from rank 0's (as a missed all-reduce would do)."""

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 1:
            with torch.no_grad():
                module.policy.layers[1].attn.wo.weight.mul_(1.5)


def test_weight_audit_stops_every_rank_when_the_replicas_diverge() -> None:
    """Each rank's engine matches its own master weights, but they are not rank 0's: the audit stops the run."""
    trainer = _trainer(2, 1, [DivergeRankOne()], logger=False)
    with pytest.raises(Exception, match="differ from rank 0's"):
        trainer.fit(_module(warmup_steps=1, warmup_lr=FROZEN_LR), datamodule=_data())


def test_evaluation_is_split_across_ranks_and_the_accuracy_gathered(runs: dict[str, Any]) -> None:
    """Each rank scores its own 8 of the 16 held-out problems; the logged accuracy is over all 16, as on one rank.
    (The engines hold the same weights here only because FROZEN_LR keeps them: the precondition of comparing
    accuracies, not a test of the weight sync, which test_a_real_step_moves_every_rank_engine_alike is.)"""
    one_prompts, (first, second) = runs["one"]["evaluated"], [r["evaluated"] for r in runs["ranks"]]
    assert len(one_prompts) == 16 and len(first) == len(second) == 8  # not all 16 on every rank
    assert sorted(first + second) == sorted(one_prompts)  # together the 16 (a few prompts occur twice in them)
    assert runs["ranks"][0]["engine"] == runs["ranks"][1]["engine"] == runs["one"]["engine"]  # same weights
    one, two = (_eval_logged(runs["one"]["logged"]), _eval_logged(runs["ranks"][0]["logged"]))
    for key in ("eval/accuracy", "eval/bf16_accuracy"):
        assert 0.0 < one[key] < 1.0, "the fixture should give a graded accuracy"
        assert two[key] == pytest.approx(one[key], rel=TOL, abs=0), key


def test_a_real_step_moves_every_rank_engine_alike(tmp_path: Path, warm: str) -> None:
    """At a real learning rate the weights move: both ranks' engines leave the warm start's FP4 bytes and arrive at
    the same new ones (DDP replicas stay identical and the sync carries the step), so equal checksums here are
    evidence of the sync, not of frozen weights."""
    trainer = _trainer(2, 1, [StepProbe(tmp_path)], logger=MemoryLogger())
    trainer.fit(_module(warmup_steps=1, warmup_lr=0.05, init_from=warm), datamodule=_data())
    ranks = [_load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["engine_at_start"] == ranks[1]["engine_at_start"]
    moved = [name for name, digest in ranks[0]["engine"].items() if digest != ranks[0]["engine_at_start"][name]]
    assert len(moved) > len(ranks[0]["engine"]) // 2, moved
    assert ranks[0]["engine"] == ranks[1]["engine"]


@pytest.mark.parametrize("config", ["ddp", "fsdp"])
def test_scaling_configs_stack_on_the_gpu_config(config: str) -> None:
    # Parse only (no CUDA here): the GPU run's batch sizes split across the 2 ranks the config asks for.
    cli = main(["--config", str(ROOT / "conf/sim.yaml")], run=False)
    args = [arg for name in ("sim", "gpu", config) for arg in ("--config", str(ROOT / f"conf/{name}.yaml"))]
    namespace = cli.parser.parse_args(args)
    assert (namespace.trainer.accelerator, namespace.trainer.devices) == ("gpu", 2)
    for size in (namespace.model.rollout.prompts_per_step, namespace.data.demo_batch_size, namespace.data.eval_size):
        assert size % 8 == 0  # also splits over 8 GPUs
