#!/usr/bin/env bash
# The real engine at full scale (issue 24), qwen3-30b-a3b shape (48 layers, random weights), in device calls of at
# most ~9 minutes each: bash tools/gpu_engine_scale.sh PART, PART one of
#   batches   bf16 / FP4 / FP4 + parity records (every layer) / FP4 + full records, prompt 512 + 256 new tokens, at
#             batch 64 and 256: tokens/s of the whole call, prefill ms, peak memory against the engine's plan
#   prefill   FP4 prefill through the FP4 kernels against dense GEMMs on dequantized weights (prefill_dense_from),
#             batch 256 x 512 prompt tokens, beside BF16; then in chunks of 128 positions (prefill_chunk): peak
#             memory against the plan
#   long      16K new tokens at each engine's own largest batch (Engine.max_batch), parity records of the 4 deepest
#             layers streamed to the host (every layer's would not fit the host's memory)
#   tail      static against continuous batching on a long-tailed length mix (64 slots)
# Logs under --out DIR (default ./gpu_out); --install installs this checkout first. The first call of a session should be tools/gpu_fit.sh (CUDA tests included).
set -uo pipefail
source "$(dirname "$0")/_gpu_args.sh"  # --out DIR (default ./gpu_out), --install
PART=${1:-batches}
export PYTHONUNBUFFERED=1
B="python3 tools/bench_engine.py --preset qwen3-30b-a3b --device cuda --repeats 2"
case "$PART" in
  batches)
    for batch in 64 256; do
      timeout 260 $B --batch $batch --prompt-len 512 --new-tokens 256 2>&1 | tee "$OUT/batches_$batch.log" | grep "^|\|Error"
    done ;;
  prefill)
    timeout 250 $B --batch 256 --prompt-len 512 --new-tokens 2 --precision bf16 --precision "nvfp4 W+A+KV (bf16 compute)" \
      2>&1 | tee "$OUT/prefill_kernels.log" | grep "^|\|Error"
    timeout 250 $B --batch 256 --prompt-len 512 --new-tokens 2 --precision "nvfp4 W+A+KV (bf16 compute)" \
      --prefill-dense-from 4096 2>&1 | tee "$OUT/prefill_dense.log" | grep "^|\|Error"
    timeout 250 $B --batch 256 --prompt-len 512 --new-tokens 2 --precision "nvfp4 W+A+KV (bf16 compute)" \
      --precision "nvfp4 W+A+KV bf16 + parity records" --prefill-chunk 128 2>&1 | tee "$OUT/prefill_chunked.log" \
      | grep "^|\|Error" ;;
  long)
    timeout 540 $B --batch 0 --prompt-len 512 --new-tokens 16384 --repeats 1 --records-to-host --record-layers 4 \
      --precision bf16 --precision "nvfp4 W+A+KV (bf16 compute)" --precision "nvfp4 W+A+KV bf16 + parity records" \
      2>&1 | tee "$OUT/long.log" | grep "^|\|Error" ;;
  tail)
    timeout 540 $B --batch 512 --prompt-len 128 --new-tokens 1024 --long-tail 64 --repeats 1 \
      --precision "nvfp4 W+A+KV (bf16 compute)" 2>&1 | tee "$OUT/tail.log" | grep -v "^#" ;;
  *) echo "unknown part $PART (batches, prefill, long, tail)"; exit 2 ;;
esac
