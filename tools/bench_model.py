"""CPU forward throughput of our Transformer against transformers' Qwen3-MoE of the same shape and weights.

Both run the same checkpoint (ours is written with ``save_hf`` and loaded by transformers), so the table also
reports the max logit difference. Implementations are timed in interleaved rounds after a warm-up and the
median is reported: on small VMs the first calls pay for page faults of fresh large allocations, and
interleaving spreads background noise evenly. small-moe runs with fewer layers by default to keep the run
short (per-layer cost is what differs; the 32k-vocab lm_head is identical in both).
Usage: ``python tools/bench_model.py [--rounds 15 --small-layers 2]``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import torch
from _bench import interleaved_medians

from trace_lightning.model import Transformer, save_hf

SHAPES = ((4, 128), (16, 8))  # (batch, seq): prefill-sized, and a small overhead-bound forward


@torch.inference_mode()
def bench(name: str, n_layers: int | None, rounds: int) -> list[tuple[str, ...]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = Transformer.from_name(name, **({"n_layers": n_layers} if n_layers else {})).eval()
    with tempfile.TemporaryDirectory() as path:
        save_hf(ours, path)
        hf = {e: AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", experts_implementation=e)
              for e in ("grouped_mm", "eager")}
    rows = []
    for batch, seq in SHAPES:
        x = torch.randint(0, ours.config.vocab_size, (batch, seq))
        ref = ours(x)
        fns: dict[str, Callable[[], object]] = {"trace_lightning": lambda x=x: ours(x)}
        diffs = {"trace_lightning": 0.0}
        for experts, model in hf.items():
            key = f"transformers Qwen3Moe ({experts} experts)"
            fns[key] = lambda x=x, model=model: model(x).logits
            diffs[key] = (model(x).logits - ref).abs().max().item()
        medians = interleaved_medians(fns, rounds, warmup=3)
        label = f"{name} ({ours.config.n_layers} layers)"
        for impl, seconds in medians.items():
            speedup = medians[impl] / medians["trace_lightning"]
            rows.append((label, f"{batch}x{seq}", impl, f"{x.numel() / seconds:,.0f}", f"{1 / speedup:.2f}x",
                         f"{diffs[impl]:.1e}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--small-layers", type=int, default=2, help="layers of small-moe (0: all 8)")
    args = parser.parse_args()
    rows = bench("debug-moe", None, args.rounds) + bench("small-moe", args.small_layers or None, args.rounds)
    header = ("model", "B x T", "implementation", "tokens/s", "vs ours", "max |dlogit|")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"CPU forward (full, incl. lm_head), fp32, {torch.get_num_threads()} threads, median of {args.rounds}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
