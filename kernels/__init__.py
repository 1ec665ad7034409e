"""Triton FP4 kernels; every op has a CPU twin in trace_lightning.sim with the same signature."""
