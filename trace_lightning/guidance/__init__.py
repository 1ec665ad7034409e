"""Rollout guidance: QuantRecord, compaction (parity + scales, depth-selective), storage and exchange."""

from trace_lightning.guidance.compaction import (
    POLICY_KINDS,
    Compaction,
    LayerPolicy,
    layer_bytes_per_token,
    parse_layer_policy,
    rank_layers_by_mismatch,
    route_bytes_per_token,
    select_layers,
)
from trace_lightning.guidance.hook import (
    FakeQuantHook,
    FiniteCheckHook,
    GuidedHook,
    NonFiniteActivationError,
    SiteAgreement,
)
from trace_lightning.guidance.record import BatchRecord, ModelIdentity, QuantRecord, SiteRecord, collate_records
from trace_lightning.guidance.store import RecordError, RecordExchange, load_record, save_record

__all__ = [
    "POLICY_KINDS",
    "BatchRecord",
    "Compaction",
    "FakeQuantHook",
    "FiniteCheckHook",
    "GuidedHook",
    "LayerPolicy",
    "ModelIdentity",
    "NonFiniteActivationError",
    "QuantRecord",
    "RecordError",
    "RecordExchange",
    "SiteAgreement",
    "SiteRecord",
    "collate_records",
    "layer_bytes_per_token",
    "load_record",
    "parse_layer_policy",
    "rank_layers_by_mismatch",
    "route_bytes_per_token",
    "save_record",
    "select_layers",
]
