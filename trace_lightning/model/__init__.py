"""The MoE transformer: config presets, one model file, Hugging Face checkpoint conversion, tokenizers."""

from trace_lightning.model.config import MoEConfig, name_to_config
from trace_lightning.model.hf import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    load_hf,
    load_hf_state_dict,
    load_hf_weights,
    save_hf,
    to_hf_state_dict,
)
from trace_lightning.model.hooks import SITES, WEIGHTS, QuantHook
from trace_lightning.model.model import (
    Attention,
    Block,
    Experts,
    KVCacheProtocol,
    Linear,
    ModelOutput,
    MoE,
    RMSNorm,
    Router,
    SharedExpert,
    Transformer,
)
from trace_lightning.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "SITES", "WEIGHTS", "Attention", "Block", "CharTokenizer", "CheckpointError", "Experts", "HFTokenizer",
    "KVCacheProtocol", "Linear", "ModelOutput", "MoE", "MoEConfig", "QuantHook", "RMSNorm", "Router",
    "SharedExpert", "Tokenizer", "Transformer", "config_from_hf", "config_to_hf", "load_hf", "load_hf_state_dict",
    "load_hf_weights", "load_tokenizer", "name_to_config", "save_hf", "to_hf_state_dict",
]
