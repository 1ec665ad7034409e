"""The weight sync of an RL step, part by part: what `WeightSync` times as `time/sync_s`.

The trainer's master weights (fp32, on the same device) go to a fresh FP4 engine through `Engine.update_weights`
bucket by bucket, as in a fit; the parts are timed alone too: the finite check with the weight digests (the records'
fingerprint; one pass serves both) and the FP4 re-quantization of the quantized layers. Median wall ms over the
repeats, the device synchronized around each, and the number of torch ops each part dispatches (launch-bound parts
show it).

Run: python tools/bench_sync.py --preset small-moe --device cuda      (CPU: --device cpu, slow but runs)
     TRITON_INTERPRET=1 python tools/bench_sync.py --preset debug-moe --set n_layers=8 --set moe_intermediate=128 \
         --device cpu --backend triton --word-layout --repeats 1
The second counts, on a CPU, the torch ops the Triton engine's sync dispatches on a GPU (--word-layout: as with bf16
compute on CUDA, where the GEMMs read the kernels' word layout); its times mean nothing. The ops the interpreter
itself dispatches inside a kernel launch are not counted.
"""

from __future__ import annotations

import argparse
import collections
import traceback
from collections.abc import Callable, Mapping

import torch
from _bench import timed_s
from torch.utils._python_dispatch import TorchDispatchMode

from trace_lightning.lit.parallel import full_weight_buckets
from trace_lightning.model import MoEConfig, Transformer
from trace_lightning.rollout import Engine, FP4Precision
from trace_lightning.rollout.engine import check_weights


class OpCount(TorchDispatchMode):
    """How many aten ops run inside the block, leaving out those Triton's CPU interpreter runs inside a launch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's API)
        if not any("triton/runtime/interpreter" in frame.filename for frame in traceback.extract_stack()):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def op_count(fn: Callable[[], object]) -> int:
    with OpCount() as counter:
        fn()
    return sum(counter.ops.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-moe")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=INT", help="a preset field override")
    parser.add_argument("--backend", default="auto", help="the engine's backend (triton on a CPU: the interpreter)")
    parser.add_argument("--word-layout", action="store_true",
                        help="the kernels' word layout wherever the compute is bf16 (as on CUDA), for op counts")
    args = parser.parse_args()
    if args.word_layout:
        from trace_lightning.kernels import layout

        layout.prefers_word_layout = lambda dtype, device, cache=False: dtype == torch.bfloat16
    config = MoEConfig.from_name(args.preset, **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    device = torch.device(args.device)
    torch.manual_seed(0)
    policy = Transformer(config).to(device)
    engine = Engine(Transformer(config).to(device).eval(), FP4Precision(compute_dtype=torch.bfloat16),
                    backend=args.backend)
    master = {name: t.detach() for name, t in policy.state_dict().items()}
    buckets = list(full_weight_buckets(master, args.bucket_mb << 20))
    fp4 = {name: t for name, t in master.items() if name in engine._fp4_weights}
    version = iter(range(1, 1 << 30))

    def sync() -> None:
        v = next(version)
        for bucket in buckets:
            engine.update_weights(bucket, v)

    def requantize() -> None:
        for name, t in fp4.items():
            module, key = engine._fp4_weights[name]
            module.set_weight(key, t)

    parts: Mapping[str, Callable[[], object]] = {
        "update_weights, every bucket (time/sync_s)": sync,
        "  finite check and byte digests (scan_tensors)": lambda: [check_weights(b, "s") for b in buckets],
        "  FP4 re-quantization (set_weight: the GEMMs' layout included)": requantize,
    }
    params = sum(t.numel() for t in master.values())
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{config.name} {' '.join(args.set)}: {params / 1e6:.0f}M parameters in {len(master)} tensors "
          f"({len(fp4)} FP4), {len(buckets)} bucket(s), {engine.ops.__name__}, {where}")
    print("| part | ms | torch ops |\n|---|---:|---:|")
    for name, fn in parts.items():
        ms = 1e3 * timed_s(fn, device, args.repeats)
        print(f"| {name} | {ms:.2f} | {op_count(fn)} |")


if __name__ == "__main__":
    main()
