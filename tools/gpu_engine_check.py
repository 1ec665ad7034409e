"""GPU smoke test of the whole rollout path: the FP4 engine on the Triton backend against the sim backend.

Both backends run on the same CUDA device with the same weights (debug-moe, random init): greedy tokens,
logprobs and captured record bytes are compared, and the guided training forward over the Triton engine's
records is checked to land on its codes; CUDA-graph decoding is checked against eager decoding (same tokens)
and timed, for the debug-moe and small-moe shapes. Prints one JSON line per check.

    python tools/gpu_engine_check.py
"""

from __future__ import annotations

import copy
import json

import torch

from trace_lightning.guidance import GuidedHook
from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    torch.manual_seed(0)
    policy = Transformer.from_name("debug-moe").cuda()
    prompts = [[1, *torch.randint(3, 100, (n,)).tolist()] for n in (5, 9, 3, 12)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = {}
    for backend in ("triton", "sim"):
        engine = Engine(copy.deepcopy(policy), FP4Precision(compute_dtype=torch.bfloat16), backend=backend)
        out[backend] = engine.generate(prompts, params, capture=CaptureSpec(layers="all"))
    t, s = out["triton"], out["sim"]
    same_tokens = sum(a == b for a, b in zip(t.responses, s.responses, strict=True))
    lp_diff = max(abs(x - y) for a, b in zip(t.logprobs, s.logprobs, strict=True) for x, y in zip(a, b, strict=False))
    # Prompt positions see identical inputs on both backends; compare their record rows site by site.
    bytes_equal = {
        f"{i}:{k[0]}:{k[1]}": bool(torch.equal(t.captures[i][k].packed[: len(p) - 1],
                                               s.captures[i][k].packed[: len(p) - 1]))
        for i, p in enumerate(prompts) for k in sorted(t.captures[i])
    }
    layer0 = [v for key, v in bytes_equal.items() if key.split(":")[1] == "0" and key.endswith("attn_in")]
    print(json.dumps({"check": "triton_vs_sim", "graph_steps": {b: o.stats["graph_steps"] for b, o in out.items()},
                      "sequences_equal": same_tokens, "of": len(prompts),
                      "max_logprob_diff": lp_diff, "prompt_record_bytes_equal_fraction":
                      sum(bytes_equal.values()) / len(bytes_equal), "layer0_attn_in_equal": all(layer0)}))
    seqs = [p + r for p, r in zip(prompts, t.responses, strict=True)]
    width = max(len(x) for x in seqs)
    tokens = torch.zeros((len(seqs), width), dtype=torch.long)
    valid = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, x in enumerate(seqs):
        tokens[i, : len(x)], valid[i, : len(x)] = torch.tensor(x), True
    full = t.record.window(width - 1)  # the engine's packed record, already on the GPU
    batch = full.compact("parity")
    hook = GuidedHook("nvfp4", batch, "parity", valid[:, :-1].cuda(), audit=full)
    with torch.no_grad():
        policy(tokens[:, :-1].cuda(), attention_mask=valid[:, :-1].cuda(), hook=hook)
    metrics = hook.metrics()
    print(json.dumps({"check": "guided_training_on_gpu_records", "code_agreement": metrics["quant/code_agreement"],
                      "value_agreement": metrics["quant/value_agreement"]}))


def graph_vs_eager(name: str, batch: int, new_tokens: int, capture: CaptureSpec | None = None) -> None:
    """Same greedy rollout with decode steps as CUDA-graph replays and eagerly: tokens, logprobs, decode time;
    with `capture`, also whether the step with records was captured and whether the records are identical."""
    torch.manual_seed(1)
    policy = Transformer.from_name(name).cuda()
    prompts = [[1, *torch.randint(3, 100, (8 + b % 5,)).tolist()] for b in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    runs = {}
    for graph in (True, False):
        engine = Engine(copy.deepcopy(policy), FP4Precision(compute_dtype=torch.bfloat16), cuda_graph=graph)
        engine.generate(prompts, params, capture=capture)  # warm-up: Triton compilation
        runs[graph] = engine.generate(prompts, params, capture=capture)
    g, e = runs[True], runs[False]
    lp_diff = max(abs(x - y) for a, b in zip(g.logprobs, e.logprobs, strict=True) for x, y in zip(a, b, strict=False))
    records = {}
    if capture is not None:
        records["records_equal"] = all(torch.equal(a[k].packed, b[k].packed) and torch.equal(a[k].scales, b[k].scales)
                                       for a, b in zip(g.captures, e.captures, strict=True) for k in a)
    print(json.dumps({"check": "cuda_graph_decode", "model": name, "batch": batch, "capture": capture is not None,
                      **records,
                      "graph_steps": g.stats["graph_steps"],
                      "same_tokens": sum(a == b for a, b in zip(g.responses, e.responses, strict=True)), "of": batch,
                      "max_logprob_diff": lp_diff,
                      "graph_ms_per_step": g.stats["decode_s"] / g.stats["decode_steps"] * 1e3,
                      "eager_ms_per_step": e.stats["decode_s"] / e.stats["decode_steps"] * 1e3}))


if __name__ == "__main__":
    main()
    graph_vs_eager("debug-moe", 8, 32)
    graph_vs_eager("small-moe", 16, 32)
    graph_vs_eager("small-moe", 16, 32, CaptureSpec(layers="all"))  # the RL path: every rollout records
