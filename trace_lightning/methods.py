"""The training methods of DESIGN.md section 6, as data: what the rollout runs and what training does.

A method is looked up by name; the trainer and the experiment tools read its fields instead of
branching on the name.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAIN_QUANT = ("none", "qat", "guided", "exact")


@dataclass(frozen=True)
class MethodSpec:
    """One training method."""

    name: str
    rollout_fp4: bool
    """The rollout engine runs FP4 weights, activations and KV cache (else BF16)."""
    train_quant: str
    """Training forward: "none" (BF16/FP32), "qat" (own-scale fake-quant), "guided" (rounds to the record), "exact"
    (the rollout's own invariant computation, trace_lightning/exact: bit for bit the rollout's logprobs)."""
    guidance_mode: str | None = None
    """Record payload for guided training: "full" codes or "parity" bits (plus scales)."""
    default_layers: str = "none"
    """Layer policy of the record (see guidance.compaction)."""
    correction: str = "none"
    """Rollout-training mismatch correction of the policy loss: "none", "tis", "mis" or "icepop"."""

    @property
    def records(self) -> bool:
        return self.train_quant == "guided"

    @property
    def exact(self) -> bool:
        """Rollout and training run one batch-invariant forward (no record, no routing replay needed)."""
        return self.train_quant == "exact"


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("bf16", rollout_fp4=False, train_quant="none"),
        MethodSpec("fp4_naive", rollout_fp4=True, train_quant="none"),
        MethodSpec("fp4_qat", rollout_fp4=True, train_quant="qat"),
        MethodSpec("fp4_qat_tis", rollout_fp4=True, train_quant="qat", correction="tis"),
        MethodSpec("fp4_qat_icepop", rollout_fp4=True, train_quant="qat", correction="icepop"),
        MethodSpec("trace", rollout_fp4=True, train_quant="guided", guidance_mode="full", default_layers="all"),
        MethodSpec(
            "trace_compact", rollout_fp4=True, train_quant="guided", guidance_mode="parity", default_layers="all"
        ),
        MethodSpec("trace_exact", rollout_fp4=True, train_quant="exact"),
    )
}


def get_method(name: str) -> MethodSpec:
    if name not in METHODS:
        raise ValueError(f"unknown trace.method {name!r}; expected one of {sorted(METHODS)}")
    return METHODS[name]
