"""Data-parallel RL that computes what one process with the whole batch would compute.

Each data-parallel rank rolls out its own share of a step's prompts (whole GRPO groups, so advantages are
computed where the group lives) and trains on it. DDP and FSDP average gradients over ranks, which equals
the one-process gradient only when every rank's loss is its share of the global loss: a token mean over
one rank's tokens must be rescaled by (local tokens * ranks / global tokens). `loss_scale` returns that
factor for each aggregation mode (exactly 1.0 on one rank). Under FSDP the master weights are sharded;
`full_weight_buckets` gathers them for the rollout engine one bucket (one collective) at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallel:
    """Where this process sits among the replicas that each see a different share of the data."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, strategy: Any) -> DataParallel:
        """From a Lightning strategy: its distributed-sampler view (the data-parallel mesh under FSDP)."""
        try:
            kwargs = strategy.distributed_sampler_kwargs
        except (AttributeError, RuntimeError):  # single-device strategies, or a mesh not set up yet
            return cls()
        if not kwargs:
            return cls()
        return cls(rank=int(kwargs["rank"]), size=int(kwargs["num_replicas"]))

    def share(self, items: Sequence[T], what: str) -> list[T]:
        """This rank's contiguous share of items; the count must split evenly (no rank pads or repeats)."""
        if len(items) % self.size:
            raise ValueError(f"{what}={len(items)} does not split evenly across {self.size} data-parallel ranks")
        n = len(items) // self.size
        return list(items[self.rank * n : (self.rank + 1) * n])


Reduce = Callable[[Tensor, str], Tensor]
"""(tensor, "sum" | "max") -> the reduction over data-parallel ranks."""


def loss_denominators(mask: Tensor) -> Tensor:
    """float64 [tokens, sequences with tokens, rows, width] of one rank's (B, T) response mask (on its device,
    without a host sync): the counts the agg modes divide by."""
    per_row = mask.bool().sum(dim=-1)  # (B,)
    rows, width = mask.shape
    shape = [per_row.new_tensor(rows), per_row.new_tensor(width)]
    return torch.stack([per_row.sum(), (per_row > 0).sum(), *shape]).double()


def loss_scale(mask: Tensor, agg_mode: str, dp: DataParallel, reduce: Reduce) -> Tensor:
    """Factor that turns a rank's aggregated loss into its share of the global loss under gradient averaging.

    Each agg mode divides by a count (agg_loss in rl.losses): token_mean by tokens, seq_mean_token_mean by
    sequences with tokens, seq_mean_token_sum by rows, seq_mean_token_sum_norm by rows * padded width (the
    widest rank's). scale = local count * ranks / global count; 1.0 on one rank. Returns a float32 [] tensor.
    """
    if dp.size == 1:
        return torch.ones((), device=mask.device)
    local = loss_denominators(mask)
    summed, width = reduce(local.clone(), "sum"), reduce(local[3:].clone(), "max")[0]
    return (_part_count(local, local[3], agg_mode) * dp.size / _total_count(summed, width, agg_mode)).float()


def micro_batch_share(part: Tensor, whole: Tensor, agg_mode: str) -> Tensor:
    """Factor that turns a micro-batch's aggregated loss (rows of a batch, the batch's padded width) into its share
    of the whole batch's: the sum of the micro-batches' scaled losses is the whole batch's loss. float32 []."""
    width = loss_denominators(whole)[3]
    return (_part_count(loss_denominators(part), width, agg_mode)
            / _total_count(loss_denominators(whole), width, agg_mode)).float()


def _counts(denominators: Tensor, width: Tensor, agg_mode: str) -> Tensor:
    """The count agg_mode divides by, from loss_denominators (width: the padded width it normalizes by)."""
    counts = {"token_mean": 0, "seq_mean_token_mean": 1, "seq_mean_token_sum": 2, "seq_mean_token_sum_norm": 2}
    if agg_mode not in counts:
        raise ValueError(f"unknown loss aggregation {agg_mode!r}; expected one of {sorted(counts)}")
    count = denominators[counts[agg_mode]]
    return count * width if agg_mode == "seq_mean_token_sum_norm" else count


def _part_count(denominators: Tensor, width: Tensor, agg_mode: str) -> Tensor:
    """A part's count; the means' (token_mean, seq_mean_token_mean) divide by max(count, 1) (agg_loss)."""
    count = _counts(denominators, width, agg_mode)
    return count.clamp(min=1) if agg_mode in ("token_mean", "seq_mean_token_mean") else count


def _total_count(denominators: Tensor, width: Tensor, agg_mode: str) -> Tensor:
    return _counts(denominators, width, agg_mode).clamp(min=1)


def _shard_rows(rows: int, world: int) -> list[int]:
    """Dim-0 rows of each rank's shard: FSDP2 shards like torch.chunk (ceil(rows / world) each, the last short)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _gather_full(tensors: list[DTensor], group: Any, world: int) -> list[Tensor]:
    """Full tensors of dim-0-sharded DTensors in one all-gather of every rank's flattened, padded shards."""
    rows = [_shard_rows(t.shape[0], world) for t in tensors]
    row_numel = [math.prod(t.shape[1:]) for t in tensors]
    slots = [max(r) * n for r, n in zip(rows, row_numel, strict=True)]  # each tensor's slot in the buffer
    flat = torch.cat([torch.nn.functional.pad(t.to_local().detach().reshape(-1), (0, s - t.to_local().numel()))
                      for t, s in zip(tensors, slots, strict=True)])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    out, offset = [], 0
    for t, r, n, s in zip(tensors, rows, row_numel, slots, strict=True):
        pieces = [gathered[rank][offset : offset + r[rank] * n] for rank in range(world)]
        out.append(torch.cat(pieces).view(t.shape).to(t.dtype))  # mixed dtypes were promoted in the buffer
        offset += s
    return out


def _check_placement(name: str, t: DTensor, mesh: Any) -> None:
    if t.device_mesh != mesh or t.device_mesh.ndim != 1 or t.placements != (Shard(0),):
        raise ValueError(f"weight {name!r} is placed {t.placements} on a {t.device_mesh.ndim}-D mesh; the bucketed "
                         "gather handles FSDP's Shard(0) on one data-parallel mesh, the same for the whole bucket")


def gather_bucket(bucket: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Full tensors of a bucket of master weights: its sharded ones in one all-gather, plain ones as they are."""
    sharded = {k: v for k, v in bucket.items() if isinstance(v, DTensor)}
    out = {k: v.detach() for k, v in bucket.items() if k not in sharded}
    if not sharded:
        return out
    mesh = next(iter(sharded.values())).device_mesh
    for name, t in sharded.items():
        _check_placement(name, t, mesh)
    full = _gather_full(list(sharded.values()), mesh.get_group(), mesh.size())
    out.update(zip(sharded, full, strict=True))
    return {name: out[name] for name in bucket}


def full_weight_buckets(named: Mapping[str, Tensor], bucket_bytes: int) -> Iterator[dict[str, Tensor]]:
    """Full master weights in buckets of about bucket_bytes of full tensors (a tensor never splits), gathered
    one bucket at a time, so a rank holds at most one bucket of gathered weights beyond its own shards."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield gather_bucket(bucket)
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield gather_bucket(bucket)
