"""Rollout guidance: QuantRecord, compaction (parity + scales, depth-selective), storage and exchange."""
