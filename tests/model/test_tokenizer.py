"""CharTokenizer for the simulator, and the wrapper over a local tokenizer.json."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trace_lightning.model import CharTokenizer, MoEConfig, load_tokenizer


def test_char_tokenizer_round_trips_and_fits_debug_moe() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 100 <= MoEConfig.from_name("debug-moe").vocab_size
    text = "12+34=46\n\tAnswer: {x} ~"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == len(text) + 2
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
    assert tok.encode(" ") == [5]  # specials, then tab and newline, then space


def test_char_tokenizer_names_unknown_characters() -> None:
    with pytest.raises(ValueError, match="cannot encode 'é' at position 2"):
        CharTokenizer().encode("caé")
    with pytest.raises(ValueError, match="token id 100 is outside"):
        CharTokenizer().decode([3, 100])


def write_word_tokenizer(folder: Path, with_config: bool) -> None:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    if with_config:
        config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("with_config", [True, False])
def test_load_tokenizer_from_folder_or_file(tmp_path: Path, with_config: bool) -> None:
    write_word_tokenizer(tmp_path, with_config)
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(source)
        assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 6)
        ids = tok.encode("hello world", bos=True, eos=True)
        assert ids == [1, 4, 5, 2]
        assert tok.decode(ids) == "hello world"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
