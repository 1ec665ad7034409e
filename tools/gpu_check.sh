#!/usr/bin/env bash
# CUDA parity tests, kernel benchmarks, decode-step benchmark. Logs go to --out DIR (default ./gpu_out).
# Usage (on the GPU machine, repo root): bash tools/gpu_check.sh [--out DIR] [--install] [rollout layers] [sections...]
set -uo pipefail
source "$(dirname "$0")/_gpu_args.sh"  # --out DIR (default ./gpu_out), --install
LAYERS=${1:-8}; shift || true
SECTIONS=${*:-copy quant linear moe attn}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 - <<'PY'
import torch  # does CUDA's float32 log2 round like the CPU's (the RCEIL emulation assumes correct rounding)?
m = torch.arange(0, 64, dtype=torch.int32)
e = torch.arange(-126, 127, dtype=torch.int32)
v = (((e[:, None] + 127) << 23) | m[None, :]).view(torch.float32).reshape(-1)
a, b = torch.ceil(torch.log2(v)), torch.ceil(torch.log2(v.cuda())).cpu()
print("log2 ceil mismatches cpu vs cuda:", int((a != b).sum()), "of", v.numel())
PY
timeout ${PYTEST_S:-170} python3 -m pytest -q -p no:cacheprovider tests/kernels tests/sim tests/test_no_hf_kernels.py \
  2>&1 | tee "$OUT/pytest.log" | tail -25
TUNE=""; [ "${AUTOTUNE:-0}" = 1 ] && TUNE=--autotune  # AUTOTUNE=1: autotuned block shapes (KernelOptions.autotune)
timeout ${KERNELS_S:-200} python3 tools/bench_kernels.py --only $SECTIONS $TUNE 2>&1 | tee "$OUT/bench_kernels.log" | grep -v '^{'
timeout ${ROLLOUT_S:-240} python3 tools/bench_rollout.py --layers "$LAYERS" $TUNE 2>&1 | tee "$OUT/bench_rollout.log" | grep -v '^{'
