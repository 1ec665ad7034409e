#!/usr/bin/env bash
# One device call for the whole GPU story: parity tests, attention launch sweep, kernel (quantizers included) /
# decode-step / long-rollout benchmarks (the long one with the sweep's best attention shape for that size), engine
# check, HF peer baseline and
# per-kernel profiles of the synthetic step and of the real engine. Logs under --out DIR (default ./gpu_out); a short summary on stdout.
# Usage: bash tools/gpu_full.sh [--out DIR] [--install] [--quick]   (the MoE / linear launch sweeps are separate: tools/sweep_moe.py, sweep_linear.py)
# --quick (~6 minutes instead of ~8.5, for short device windows): parity tests, decode step, RoPE and router
# before / after, long rollouts with the default attention shape, the synthetic step's profile and the engine check.
set -uo pipefail
source "$(dirname "$0")/_gpu_args.sh"  # --out DIR (default ./gpu_out), --install
QUICK=0; [ "${1:-}" = "--quick" ] && QUICK=1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/pytest.log" | tail -2
cd tools
LONG=""  # the sweep's best attention shape for the long rollouts; empty: the kernel's default
if [ $QUICK = 0 ]; then
  timeout 150 python3 sweep_attention.py 2>&1 | tee "$OUT/sweep_attention.log" | grep -v "^#"
  LONG=$(grep "BEST B=250" "$OUT/sweep_attention.log" | sed 's/.*--attention-shape //')
fi
long() {  # long 16K rollouts, with the sweep's shape when there is one
  if [ -n "$LONG" ]; then "$@" --attention-shape "$LONG"; else "$@"; fi
}
timeout 100 python3 bench_rollout.py --layers 8 --batches 1 16 64 256 2>&1 | tee "$OUT/bench_rollout.log" | grep "^| fp4\|^| bf16" | cut -d'|' -f2,3,6,7,8,12,13
echo "## the same at batch 64 with the q / k norm + RoPE as torch ops (the before of kernels.rope)"
timeout 60 python3 bench_rollout.py --layers 8 --batches 64 --unfused-rope 2>&1 | grep "^| fp4\|^| bf16" | cut -d'|' -f2,3,6
echo "## the same at batch 64 with the router's softmax + top-k as torch ops (the before of kernels.route_topk)"
timeout 60 python3 bench_rollout.py --layers 8 --batches 64 --torch-router 2>&1 | grep "^| fp4\|^| bf16" | cut -d'|' -f2,3,6
long timeout 120 python3 bench_rollout.py --layers 8 --long 16384 2>&1 \
  | tee "$OUT/bench_long.log" | grep "^| fp4\|^| bf16\|FP4 / BF16"
if [ $QUICK = 0 ]; then
  timeout 150 python3 bench_kernels.py --only copy quant linear moe attn 2>&1 | tee "$OUT/bench_kernels.log" | grep "fp4\|bf16" | cut -d'|' -f2-4,7-8
fi
timeout 100 python3 gpu_engine_check.py 2>&1 | tee "$OUT/engine_check.log" | grep "cuda_graph\|triton_vs_sim"
if [ $QUICK = 0 ]; then
  timeout 170 python3 bench_hf_peer.py --layers 4 --batches 1 64 --new-tokens 32 --prompt-len 256 2>&1 \
    | tee "$OUT/bench_hf.log" | grep "^|"
fi
timeout 60 python3 profile_step.py --layers 4 --batch 64 2>&1 | tee "$OUT/profile.log" | grep -A9 "fp4 batch"
if [ $QUICK = 0 ]; then
  timeout 100 python3 profile_engine.py --layers 4 --batch 64 2>&1 | tee "$OUT/profile_engine.log" | grep -A6 "^## engine"
fi
echo "## CUDA tests: $(tail -1 "$OUT/pytest.log")"  # last, so it is in the reply's tail
