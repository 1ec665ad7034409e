"""Peer baseline: Hugging Face transformers `generate` (bf16) against our engine (bf16 and FP4) on the same
reduced-depth model of the qwen3-30b-a3b layer shape, decode time per step and per layer.

Run: python tools/bench_hf_peer.py --layers 4 --batches 1 16 64 --new-tokens 64 --prompt-len 512   (CUDA)
     python tools/bench_hf_peer.py --device cpu --preset debug-moe --layers 2 --batches 2 --new-tokens 4 \\
         --prompt-len 8                                                            (CPU smoke test)
Same random weights (std 0.02) in all three: ours is built, written with save_hf and read by transformers.
Decode time per step = (t(N new tokens) - t(1 new token)) / (N - 1), so prefill drops out; greedy, no stop
tokens; median of 3 timed runs after a warm-up. Our engine replays decode steps as a CUDA graph on GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from collections.abc import Callable

import torch
from _bench import Report, timed_s
from torch import Tensor

from trace_lightning.model import Transformer
from trace_lightning.model.hf import save_hf
from trace_lightning.rollout import Engine, FP4Precision, SamplingParams


def hf_generate(model, ids: Tensor, new: int, cache: str | None) -> Callable[[], object]:  # noqa: ANN001
    kwargs = {"cache_implementation": cache} if cache else {}
    return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, use_cache=True, pad_token_id=0, **kwargs)


def decode_ms(make: Callable[[int], Callable[[], object]], new: int, device: torch.device) -> float:
    """ms per decode step: the N-token run minus the 1-token run (prefill + first token), over N - 1 steps."""
    return (timed_s(make(new), device) - timed_s(make(1), device)) / (new - 1) * 1e3


@torch.inference_mode()
def logits_rel_diff(ours: Transformer, hf, device: torch.device) -> float:  # noqa: ANN001
    """||ours - hf|| / ||hf|| of the logits on one short prompt: both really are the same model."""
    ids = torch.arange(3, 19, device=device)[None]
    a = ours(ids).float()
    b = hf(ids).logits.float()
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_hf_peer needs a CUDA device (or --device cpu for the smoke test)")
    if device.type == "cpu":
        torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = Transformer.from_name(args.preset, n_layers=args.layers, init_std=0.02,
                                 max_seq_len=args.prompt_len + args.new_tokens + 8).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(ours, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    ours = ours.to(device)  # one device copy: the parity check runs on it, each engine converts its own copy
    same = logits_rel_diff(ours, hf, device)
    print(f"# same model check: relative logit difference ours vs transformers (bf16) = {same:.2e}", flush=True)
    if same > 0.05:
        print("# WARNING: the two models disagree; the comparison below is not like for like", file=sys.stderr)
    engines = {"ours bf16": Engine(copy.deepcopy(ours), "bf16"),
               "ours fp4": Engine(copy.deepcopy(ours), FP4Precision(compute_dtype=torch.bfloat16))}
    del ours
    rep = Report(["impl", "batch", "decode_ms_per_step", "ms_per_layer", "tok_per_s", "note"])
    vocab = hf.config.vocab_size
    for B in args.batches:
        prompts = torch.randint(3, vocab, (B, args.prompt_len), generator=torch.Generator().manual_seed(B))
        ids = prompts.to(device)
        for cache in ("static", None):  # a static cache is HF's fastest decode path; fall back to the default
            try:
                with torch.inference_mode():
                    ms = decode_ms(lambda n, c=cache, x=ids: hf_generate(hf, x, n, c), args.new_tokens, device)
            except Exception as err:  # noqa: BLE001  (report and try the next cache / implementation)
                print(f"# hf generate cache={cache}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                continue
            rep.add(impl="hf generate bf16", batch=B, decode_ms_per_step=ms, ms_per_layer=ms / args.layers,
                    tok_per_s=B / ms * 1e3, note=f"cache={cache or 'dynamic'}")
            break
        rows = prompts.tolist()
        for name, engine in engines.items():
            def run(n: int, engine: Engine = engine, rows: list[list[int]] = rows) -> Callable[[], object]:
                return lambda: engine.generate(rows, SamplingParams(max_new_tokens=n, temperature=0.0))
            try:
                ms = decode_ms(run, args.new_tokens, device)
            except Exception as err:  # noqa: BLE001
                print(f"# {name}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                continue
            graph = engine.generate(rows, SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0))
            rep.add(impl=name, batch=B, decode_ms_per_step=ms, ms_per_layer=ms / args.layers, tok_per_s=B / ms * 1e3,
                    note=f"graph steps {int(graph.stats.get('graph_steps', 0))}")
    print(f"\n## decode per step, {args.preset} layer shape x {args.layers} layers, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}\n")
    print(rep.table())


if __name__ == "__main__":
    main()
