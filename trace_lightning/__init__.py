"""trace-lightning: FP4 reinforcement learning for MoE language models with train-rollout quantization alignment."""
