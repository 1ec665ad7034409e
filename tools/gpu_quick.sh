#!/usr/bin/env bash
# A shorter device call than gpu_full.sh (about 6 minutes): CUDA parity tests, the decode step at every batch,
# the q / k norm + RoPE before / after at batch 64, the long 16K rollouts (default attention shape), the per-kernel
# profile at batch 64 and the engine check. Summary on stdout, logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRACE_LIGHTNING_AUTOTUNE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/pytest.log" | tail -2
cd tools
timeout 100 python3 bench_rollout.py --layers 8 --batches 1 16 64 256 2>&1 | tee "$OUT/bench_rollout.log" \
  | grep "^| fp4\|^| bf16" | cut -d'|' -f2,3,6,7,8,12,13
echo "## batch 64 with the q / k norm + RoPE as torch ops"
timeout 60 python3 bench_rollout.py --layers 8 --batches 64 --unfused-rope 2>&1 | grep "^| fp4\|^| bf16" | cut -d'|' -f2,3,6
timeout 120 python3 bench_rollout.py --layers 8 --long 16384 2>&1 | tee "$OUT/bench_long.log" | grep "^| fp4\|^| bf16\|FP4 / BF16"
timeout 60 python3 profile_step.py --layers 4 --batch 64 --top 24 2>&1 | tee "$OUT/profile.log" | grep "^|\|^##"
timeout 100 python3 gpu_engine_check.py 2>&1 | tee "$OUT/engine_check.log" | grep "cuda_graph\|triton_vs_sim"
echo "## CUDA tests: $(tail -1 "$OUT/pytest.log")"
