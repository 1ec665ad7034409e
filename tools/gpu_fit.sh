#!/usr/bin/env bash
# The GPU fit (issue 23) in one device call of about 9 minutes, in the order that pays if time runs out:
#   1. the CUDA tests of the one quantization definition, the engine backends, the device record and the training
#      fake-quant kernels, and trace_exact's exact Triton GEMMs (tests/kernels/test_exact_gemm.py: not yet run on a GPU);
#   2. `trace-rl fit` on conf/gpu.yaml for a short run (warm start, then RL with the weight audit on): the step-time
#      breakdown, rollout tokens/s inside the fit, sync time, 0 mismatching weight bytes, guided agreement;
#   3. the standalone engine at the fit's shape (small-moe, 64 x 8 rollouts, 128 new tokens, parity records), the
#      figure the fit's rollout tokens/s is compared with;
#   4. the fit's TensorBoard scalars as a table (tools/tb_summary.py), and the weight sync part by part
#      (tools/bench_sync.py);
#   5. (in the fit part) the fit's rollout from its step-50 checkpoint against the standalone engine at the same
#      response lengths (tools/bench_fit_rollout.py): the in-fit >= 50% comparison at equal lengths;
#   6. (part `methods`, not in `all`) bf16, fp4_qat and trace_compact from one shared warm start, RL_STEPS each
#      (tools/run_methods.py, resumable: call it again on the same warm machine and it goes on where the last call's
#      time limit stopped it); results.md's GPU section, its figures and the per-method JSON come back in $OUT;
#      SEEDS="1 2" runs those seeds (default 0): a session's JSON files kept in the repository and passed to a later
#      report with `tools/run_methods.py --report --merge DIR` add seeds across sessions;
#   8. (part `long`, not in `all`) conf/gpu_long.yaml, the long-response fit: 20 warm-start steps (LONG_WARMUP), then RL_STEPS RL
#      steps of 256 x 1024-token rollouts, for each METHOD in turn (default trace_compact then bf16), same seed; the
#      step-time breakdown of each as a table; PROFILE_STEP=N profiles global step N's training (StepProfiler) and
#      prints its largest kernels (a step of 128 micro-batches profiles for minutes: shrink it with, e.g.,
#      LONG_ARGS="--model.rollout.prompts_per_step 4"; LONG_ARGS is added to the fit's arguments); PROFILE_TRACE=1 also
#      writes that step's Chrome trace and prints where the device waited in it (tools/trace_gaps.py);
#   9. (part `exact`, not in `all`) conf/gpu.yaml with trace_exact, then trace_compact (EXACT_METHODS), EXACT_WARMUP
#      (20) warm-start + RL_STEPS RL steps each, micro-batches of EXACT_MICRO_BATCH (64): every RL step's k3_kl and
#      the step-time breakdown of each (EXACT_ARGS is added to the fits' arguments; "--model.trace.backend triton"
#      runs the exact Triton kernels, slower than the default torch path on an H100: docs/exact.md);
#   7. (part `frontier`, not in `all`) k3_kl against record bytes/token over the layer policies (tools/mismatch_table.py
#      --policies) on the fit's checkpoint if the machine still holds it, else after a 300-step warm start.
# Needs this checkout installed (pip, editable), or --install; a machine without a package index installs the
# wheels tools/offline_wheels.sh gathered into .whl/ with --install.
# Usage: bash tools/gpu_fit.sh [--out DIR] [--install] [RL_STEPS] [all|tests|fit|bench|methods|frontier|long|exact] [METHOD ...]   (default 30 RL steps after 20 warm-start steps: the
# step-50 checkpoint conf/gpu.yaml saves is the one part 5 rolls out from)
set -uo pipefail
source "$(dirname "$0")/_gpu_args.sh"  # --out DIR (default ./gpu_out), --install
RL=${1:-30}
PART=${2:-all}  # all, or one of tests / fit / bench: shorter calls lose less when a machine is taken back
shift $(( $# < 2 ? $# : 2 ))
LONG_METHODS=${*:-trace_compact bf16}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  echo "## 1. CUDA tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/quant/test_one_definition.py \
    tests/kernels/test_one_definition.py tests/kernels/test_engine_backends.py tests/kernels/test_record_slot.py \
    tests/rollout/test_decode_graph.py tests/rollout/test_device_record.py tests/rollout/test_continuous.py \
    tests/rollout/test_convert.py tests/rollout/test_memory.py tests/kernels/test_fake_quant.py \
    tests/guidance/test_fused_fake_quant.py tests/kernels/test_exact_gemm.py tests/lit/test_prefetch.py \
    tests/guidance/test_record_transfer.py \
    2>&1 | tee "$OUT/pytest.log" | tail -6
fi
if [ "$PART" = all ] || [ "$PART" = fit ]; then
  echo "## 2. trace-rl fit, conf/gpu.yaml, 20 warm-start + $RL RL steps"
  rm -rf runs/gpu
  timeout 300 python3 -m trace_lightning.lit.cli fit --config conf/sim.yaml --config conf/gpu.yaml \
    --trainer.max_steps $((20 + RL)) --model.warmup_steps 20 --trainer.val_check_interval $((20 + RL)) 2>&1 \
    | tee "$OUT/fit.log" | grep -v Warning | tail -12
  cp -r runs/gpu "$OUT/runs_gpu" 2>/dev/null
  echo "## the fit's scalars"
  RUN=$(ls -d runs/gpu/*/version_* 2>/dev/null | head -1)
  [ -n "$RUN" ] && python3 tools/tb_summary.py "$RUN" --match time/ rollout/ train/tokens memory/ agreement/ \
    quant/code quant/value mismatch/k3 reward/mean guidance/ eval/ sync | tee "$OUT/fit_scalars.md"
  echo "## the BF16 reference's mismatch (a bf16 rollout against the same training forward)"
  [ -d "$RUN/bf16_reference" ] && python3 tools/tb_summary.py "$RUN/bf16_reference" --match mismatch/k3 \
    | tee "$OUT/fit_bf16_reference.md"
  echo "## 5. the fit's rollout against the standalone engine at the same lengths"
  CKPT=$(ls "$RUN"/checkpoints/last.ckpt 2>/dev/null | head -1)
  timeout 120 python3 tools/bench_fit_rollout.py --config conf/sim.yaml --config conf/gpu.yaml --steps 4 --fixed \
    ${CKPT:+--init-from "$CKPT"} 2>&1 | tee "$OUT/bench_fit_rollout.log" | grep "^|\|^means\|^small\|Error"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  echo "## 3. the standalone engine at the fit's shape"
  timeout 150 python3 tools/bench_engine.py --preset small-moe --device cuda --batch 512 --prompt-len 24 \
    --new-tokens 128 --repeats 2 2>&1 | tee "$OUT/bench_engine.log" | grep "^|\|Error\|error"
  echo "## 4. the weight sync, part by part (small-moe: the fit's time/sync_s)"
  timeout 60 python3 tools/bench_sync.py --preset small-moe 2>&1 | tee "$OUT/bench_sync.log" | grep "^|\|Error"
fi
if [ "$PART" = methods ]; then
  echo "## 6. bf16 / fp4_qat / trace_compact on the GPU, $RL RL steps each from one warm start (resumable)"
  timeout 560 python3 tools/run_methods.py --config conf/gpu.yaml --methods bf16 fp4_qat trace_compact \
    --seeds ${SEEDS:-0} --warmup-steps 300 --rl-steps "$RL" --out runs/methods_gpu --name gpu 2>&1 \
    | tee "$OUT/methods.log" | grep "^{\|Error\|error" | tail -8
  mkdir -p "$OUT/methods" && cp runs/methods_gpu/*.json docs/results.md docs/figures/gpu_* "$OUT/methods/" 2>/dev/null
fi
if [ "$PART" = exact ]; then
  for METHOD in ${EXACT_METHODS:-trace_exact trace_compact}; do
    WARM=${EXACT_WARMUP:-20}
    echo "## 9. conf/gpu.yaml with $METHOD: $WARM warm-start + $RL RL steps (issue 39: k3_kl exactly 0 on the GPU)"
    rm -rf runs/gpu
    timeout -k 15 ${EXACT_TIMEOUT:-280} python3 -m trace_lightning.lit.cli fit --config conf/sim.yaml --config conf/gpu.yaml \
      --config "conf/method/$METHOD.yaml" --trainer.max_steps $((WARM + RL)) --model.warmup_steps "$WARM" \
      --trainer.val_check_interval $((WARM + RL)) --trainer.limit_val_batches 0 \
      --model.micro_batch_size ${EXACT_MICRO_BATCH:-64} ${EXACT_ARGS:-} 2>&1 | tee "$OUT/exact_$METHOD.log" \
      | grep -v Warning | tail -6
    RUN=$(ls -d runs/gpu/*/version_* 2>/dev/null | head -1)
    [ -n "$RUN" ] && python3 tools/tb_summary.py "$RUN" --match time/ rollout/tokens memory/ mismatch/ reward/mean \
      guidance/exchange | tee "$OUT/exact_$METHOD.md"
    mkdir -p "$OUT/exact_$METHOD"
    [ -n "$RUN" ] && (cd "$RUN" && find . -name 'events.*' -exec cp --parents {} "$OUT/exact_$METHOD" \;)
  done
fi
if [ "$PART" = frontier ]; then
  echo "## 7. the depth frontier of a GPU-trained small-moe (countdown), parity records over layer policies"
  CKPT=$(ls runs/gpu/*/version_*/checkpoints/last.ckpt 2>/dev/null | head -1)
  timeout 560 python3 tools/mismatch_table.py --preset small-moe --env countdown --device cuda --policies --steps 4 \
    --prompts 64 --max-new-tokens 128 --json "$OUT/frontier.json" ${CKPT:+--checkpoint "$CKPT"} \
    $([ -z "$CKPT" ] && echo --train-steps 300) 2>&1 | tee "$OUT/frontier.log" | grep "^#\|^| \|Error" | head -60
fi
if [ "$PART" = long ]; then
  for METHOD in $LONG_METHODS; do
    WARM=${LONG_WARMUP:-20}
    echo "## 8. the long-response fit (conf/gpu_long.yaml), $METHOD: $WARM warm-start + $RL RL steps"
    rm -rf runs/gpu
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 15 ${LONG_TIMEOUT:-280} python3 -m trace_lightning.lit.cli fit --config conf/sim.yaml --config conf/gpu.yaml \
      --config conf/gpu_long.yaml --config "conf/method/$METHOD.yaml" --trainer.max_steps $((WARM + RL)) \
      --model.warmup_steps "$WARM" --trainer.val_check_interval $((WARM + RL)) --trainer.limit_val_batches 0 \
      ${PROFILE_STEP:+--trainer.callbacks+=trace_lightning.lit.profiling.StepProfiler --trainer.callbacks.step=$PROFILE_STEP} \
      ${PROFILE_STEP:+${PROFILE_TRACE:+--trainer.callbacks.trace=true}} \
      ${LONG_ARGS:-} \
      2>&1 | tee "$OUT/long_$METHOD.log" | grep -v Warning | tail -6
    RUN=$(ls -d runs/gpu/*/version_* 2>/dev/null | head -1)
    [ -n "$RUN" ] && python3 tools/tb_summary.py "$RUN" --match time/ rollout/ train/tokens memory/ mismatch/k3 \
      reward/mean | tee "$OUT/long_$METHOD.md"
    mkdir -p "$OUT/long_$METHOD"
    [ -n "$RUN" ] && (cd "$RUN" && find . -name 'events.*' -exec cp --parents {} "$OUT/long_$METHOD" \;)
    if [ -n "$RUN" ] && cp "$RUN"/profile_step*.txt "$OUT/long_$METHOD/" 2>/dev/null; then
      head -40 "$RUN"/profile_step*.txt; grep -A 30 "^sorted by self_cpu" "$RUN"/profile_step*.txt; fi
    for TRACE in "$RUN"/profile_step*.json; do  # PROFILE_TRACE=1: where the device waits in the profiled step
      [ -f "$TRACE" ] || continue
      python3 tools/trace_gaps.py "$TRACE" --rows 15 | tee "$OUT/long_$METHOD/gaps.md"
      gzip -c "$TRACE" > "$OUT/long_$METHOD/$(basename "$TRACE").gz"
    done
  done
fi
