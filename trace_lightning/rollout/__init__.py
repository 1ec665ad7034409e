"""The embedded rollout engine: KV cache, prefill/decode, sampling, FP4 weights, record capture, weight sync."""

from trace_lightning.rollout.batch import CaptureSpec, RolloutBatch, SamplingParams
from trace_lightning.rollout.cache import FP4KVCache, KVCache
from trace_lightning.rollout.capture import FP4ActivationHook, Recorder, RowBuffer
from trace_lightning.rollout.convert import (
    FP4Experts,
    FP4Linear,
    WeightChecksumError,
    check_weight_checksums,
    convert_to_fp4,
    fp4_checksum,
    fp4_weight_checksums,
    is_fp4_weight,
    quantize_weight,
)
from trace_lightning.rollout.engine import Engine
from trace_lightning.rollout.precision import FP4Precision, resolve_precision
from trace_lightning.rollout.sampling import sample, sequence_seeds

__all__ = [
    "CaptureSpec", "Engine", "FP4ActivationHook", "FP4Experts", "FP4KVCache", "FP4Linear", "FP4Precision",
    "KVCache", "Recorder", "RolloutBatch", "RowBuffer", "SamplingParams", "WeightChecksumError",
    "check_weight_checksums", "convert_to_fp4", "fp4_checksum", "fp4_weight_checksums", "is_fp4_weight",
    "quantize_weight", "resolve_precision", "sample", "sequence_seeds",
]
