"""Write a tiny random Qwen3-MoE Hugging Face checkpoint with a character tokenizer, to try the HF path offline.

    python tools/tiny_hf_checkpoint.py /tmp/tiny-qwen3-moe
    trace-rl fit --config conf/sim.yaml --config conf/model/hf_checkpoint.yaml --model.checkpoint /tmp/tiny-qwen3-moe

The folder holds what a downloaded checkpoint holds (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template), so the same command works with a real Qwen3-MoE / OLMoE /
Mixtral / Qwen2-MoE folder.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML, as Qwen's instruct checkpoints frame a conversation: prompts become a user turn, responses end at
<|im_end|> (the eos token)."""
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def write_tokenizer(folder: Path) -> int:
    """A character-level tokenizer.json (every printable ASCII character one token) with a ChatML chat template;
    returns its vocab size."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARACTERS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    # tokenizer_class: transformers would otherwise read it as the model type's own (Qwen2's byte-level BPE)
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def write_checkpoint(folder: Path, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    config = Qwen3MoeConfig(vocab_size=128 * ((vocab + 127) // 128), hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048,
                            bos_token_id=1, eos_token_id=SPECIALS.index("<|im_end|>"), pad_token_id=0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_checkpoint(args.folder, args.seed)
    print(f"wrote {args.folder}: {sorted(p.name for p in args.folder.iterdir())}")


if __name__ == "__main__":
    main()
