"""The embedded rollout engine: KV cache, prefill/decode, sampling, FP4 weights, record capture, weight sync."""
