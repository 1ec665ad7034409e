"""Bytes a decode step must move, from the engine's own tensors: the floor a step's time is measured against.

A decode step of a memory-bound MoE reads every dense weight once, the weights of each expert some token of the
batch routes to, every row's cached keys and values, and writes one position of cache and of record per row. At a
batch of 64 nearly every expert of a 128-expert top-8 layer is touched; at 4 only a quarter. The expected number of
distinct experts touched under uniform routing, E * (1 - (1 - k/E)^B), is what a random model's router gives and
the floor a trained router's (more skewed, fewer experts) stays under. Dividing these bytes by a step's time gives
the achieved bandwidth, and by the card's measured copy bandwidth the fraction of the roofline reached.
"""

from __future__ import annotations

from dataclasses import dataclass

from trace_lightning.model.config import MoEConfig


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one decode step of `batch` rows reads and writes, by what they are."""

    weights: float
    """Dense weights in full, the touched experts' weights, the embedding rows looked up."""
    kv: float
    """Every row's cached positions read, every layer, plus the new position written."""
    records: float
    """Record and route bytes written for the step's tokens."""

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.records


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer runs for `tokens` tokens routed uniformly, top_k each."""
    if not 0 < top_k <= n_experts or tokens < 0:
        raise ValueError(f"need 0 < top_k <= n_experts and tokens >= 0, got {top_k}, {n_experts}, {tokens}")
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_traffic(config: MoEConfig, weight_bytes: dict[str, int], batch: int, context: float,
                        kv_bytes_per_token: float, record_bytes_per_token: float = 0.0) -> StepTraffic:
    """The bytes of one decode step of `batch` rows whose caches hold `context` positions on average.

    weight_bytes: each weight's bytes as the engine holds it (FP4 codes and scales, or dense), by parameter name
    (Engine.weight_bytes_by_name). kv_bytes_per_token: cache bytes of one position over all layers.
    """
    touched = experts_touched(config.n_experts, config.top_k, batch) / config.n_experts
    weights = 0.0
    for name, nbytes in weight_bytes.items():
        if ".experts." in name:  # stacked routed experts [E, ...]: only the touched ones are read
            weights += nbytes * touched
        elif name == "tok_embeddings.weight" and not config.tie_embeddings:  # a gather of the batch's rows
            weights += nbytes * min(batch, config.vocab_size) / config.vocab_size
        else:
            weights += nbytes
    kv = batch * (context + 1) * kv_bytes_per_token
    return StepTraffic(weights=weights, kv=kv, records=batch * record_bytes_per_token)
