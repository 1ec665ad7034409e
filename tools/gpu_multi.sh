#!/usr/bin/env bash
# The multi-GPU run (issue 29) in one device call on an nvidia-h200-x2 (or larger) machine, after tools/gpu_fit.sh
# has shown the one-GPU fit: the same short fit on 1 and on N GPUs with DDP (audit on), then a few FSDP2 RL steps of
# the olmoe-1b-7b shape (random init, the rollout engine gets full weights bucket by bucket). Per run: rollout tokens/s,
# step time, sync time, peak memory (tools/tb_summary.py). NVLink multicast stays off (KINDS.md): NCCL_NVLS_ENABLE=0.
# Usage: bash tools/gpu_multi.sh [--out DIR] [--install] [N_GPUS] [RL_STEPS]. Written without a
# multi-GPU machine to try it on: the first call is also its test.
set -uo pipefail
source "$(dirname "$0")/_gpu_args.sh"  # --out DIR (default ./gpu_out), --install
N=${1:-2}; RL=${2:-10}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
STEPS=$((10 + RL))
fit() {  # fit NAME ARGS...: a short fit into runs/multi/NAME, its scalars as a table
  local name=$1; shift
  echo "## $name"
  timeout 240 python3 -m trace_lightning.lit.cli fit --config conf/sim.yaml --config conf/gpu.yaml "$@" --trainer.max_steps $STEPS \
    --model.warmup_steps 10 --trainer.val_check_interval $STEPS --trainer.logger.init_args.save_dir runs/multi \
    --trainer.logger.init_args.name "$name" 2>&1 | tee "$OUT/$name.log" | grep -v Warning | tail -4
  local run; run=$(ls -d runs/multi/"$name"/version_* 2>/dev/null | tail -1)
  [ -n "$run" ] && python3 tools/tb_summary.py "$run" --match time/ rollout/tokens train/tokens memory/ | tee "$OUT/$name.md"
}
fit ddp1 --trainer.devices 1
fit "ddp$N" --config conf/ddp.yaml --trainer.devices "$N"
fit "fsdp$N-olmoe" --config conf/fsdp.yaml --trainer.devices "$N" --trainer.strategy.init_args.data_parallel_size "$N" \
  --model.model olmoe-1b-7b --model.rollout.prompts_per_step 16 --trainer.limit_val_batches 0  # no eval, no 84 GB checkpoint
