"""What a serving engine reads beside the weights: the tokenizer, the bos / eos / pad ids, a generation config.

``vllm serve FOLDER`` and ``transformers``' ``AutoTokenizer`` / ``AutoConfig`` / ``GenerationConfig`` each read
the folder alone, so an exported policy carries its tokenizer: a Hugging Face checkpoint's own files, copied, or,
for the presets' built-in character tokenizer, a ``tokenizer.json`` that encodes exactly as ``CharTokenizer`` does
(a BPE model without merges over the same ids, which splits text into characters) and starts every encoding with
bos, as ``CharTokenizer.encode_prompt`` does for the prompts the policy was trained on. config.json and
generation_config.json then name the ids the tokenizer defines, so a server stops where our rollouts stopped.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_lightning.model.checkpoint_files import read_json_file
from trace_lightning.model.tokenizer import CharTokenizer, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token")


@dataclass(frozen=True)
class SpecialIds:
    """The ids (and their token strings) a server needs: where a sequence starts, ends, and what pads it."""

    bos: tuple[int, str] | None
    eos: tuple[int, str] | None
    pad: tuple[int, str] | None


BUILTIN = "builtin"
"""``tokenizer_from`` naming the presets' built-in character tokenizer instead of a checkpoint folder."""


def write_serving_files(out: Path, tokenizer_from: str | Path, vocab_size: int) -> SpecialIds:
    """Give the export folder ``out`` a tokenizer (copied from the checkpoint folder ``tokenizer_from``, or the
    built-in character tokenizer's for ``BUILTIN``), tokenizer_config.json / special_tokens_map.json naming bos,
    eos and pad, their ids in config.json, and a generation_config.json; return those ids."""
    if tokenizer_from == BUILTIN:
        specials = write_char_tokenizer(out, vocab_size)
    else:
        specials = copy_hf_tokenizer(Path(tokenizer_from), out)
    write_special_tokens(out, specials)
    set_config_ids(out / "config.json", specials)
    write_generation_config(out, specials)
    return specials


def char_tokenizer_object(char: CharTokenizer | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` with ``CharTokenizer``'s ids: <pad> <bos> <eos> as special tokens, every other
    id one character, bos prepended by the post-processor, decoding by concatenation."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    char = char or CharTokenizer()
    vocab = {token: i for i, token in enumerate([*char.specials, *char.chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in char.specials])
    bos = char.specials[char.bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, char.bos_id)])
    return tok


def write_char_tokenizer(out: Path, vocab_size: int) -> SpecialIds:
    """tokenizer.json of the built-in character tokenizer (the presets' tokenizer) for a model of ``vocab_size``."""
    char = CharTokenizer()
    if vocab_size < char.vocab_size:
        raise ValueError(f"the built-in character tokenizer needs a vocabulary of {char.vocab_size} ids; the model "
                         f"has {vocab_size} (pass the checkpoint folder whose tokenizer it was trained with)")
    char_tokenizer_object(char).save(str(out / "tokenizer.json"))
    pad, bos, eos = char.specials
    return SpecialIds(bos=(char.bos_id, bos), eos=(char.eos_id, eos), pad=(char.pad_id, pad))


def copy_hf_tokenizer(source: Path, out: Path) -> SpecialIds:
    """Copy a checkpoint's tokenizer files; its bos / eos / pad as our ``HFTokenizer`` reads them (the configured
    tokens, else the usual names), so the ids the export names are the ones our rollouts used."""
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{source}: no tokenizer.json to export beside the weights (the policy's "
                                "checkpoint folder must still hold its tokenizer)")
    tokenizer = load_tokenizer(source, chat_template=False)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)

    def named(i: int | None) -> tuple[int, str] | None:
        return None if i is None else (i, tokenizer.tok.id_to_token(i))

    return SpecialIds(bos=named(tokenizer.bos_id), eos=named(tokenizer.eos_id), pad=named(tokenizer.pad_id))


def write_special_tokens(out: Path, specials: SpecialIds) -> None:
    """tokenizer_config.json (kept where it exists) and special_tokens_map.json naming bos / eos / pad."""
    file = out / "tokenizer_config.json"
    config = read_json_file(file, "tokenizer config") if file.exists() else {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    tokens = {key: value[1] for key, value in zip(SPECIAL_KEYS, (specials.bos, specials.eos, specials.pad),
                                                  strict=True) if value is not None}
    config.update({key: token for key, token in tokens.items() if config.get(key) is None})
    file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = out / "special_tokens_map.json"
    if not special_map.exists():
        special_map.write_text(json.dumps(tokens, indent=2, ensure_ascii=False) + "\n")


def set_config_ids(config_file: Path, specials: SpecialIds) -> None:
    """config.json's bos_token_id / eos_token_id / pad_token_id: the tokenizer's."""
    config = read_json_file(config_file, "config")
    for key, value in (("bos_token_id", specials.bos), ("eos_token_id", specials.eos),
                       ("pad_token_id", specials.pad)):
        if value is not None:
            config[key] = value[0]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_generation_config(out: Path, specials: SpecialIds) -> None:
    """generation_config.json: the checkpoint's own where it was copied (its eos list may hold more stop ids),
    else bos / eos / pad."""
    file = out / "generation_config.json"
    if file.exists():
        return
    config = {key: value[0] for key, value in (("bos_token_id", specials.bos), ("eos_token_id", specials.eos),
                                                ("pad_token_id", specials.pad)) if value is not None}
    file.write_text(json.dumps(config, indent=2) + "\n")
