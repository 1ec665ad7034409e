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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INST = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def write_chat_tokenizer(folder: Path, template: object, as_file: bool = False) -> None:
    """A byte-level BPE tokenizer with ChatML's special tokens (as Qwen's) and a chat template."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["user assistant: what is 3 + 4? [INST] answer [/INST]"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": "</s>"}
    if as_file:
        (folder / "chat_template.jinja").write_text(str(template))
    elif template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("template, as_file", [(CHATML, False), (INST, True),
                                               ([{"name": "tool_use", "template": "x"},
                                                 {"name": "default", "template": CHATML}], False)],
                         ids=["chatml", "inst-jinja-file", "named-list"])
def test_prompts_render_as_transformers_renders_the_chat_template(tmp_path: Path, template: object,
                                                                  as_file: bool) -> None:
    """The ids of a prompt are transformers' apply_chat_template ids (one user turn, generation prompt), special
    tokens included; without the template (chat_template=False) bos + the text."""
    from transformers import AutoTokenizer

    write_chat_tokenizer(tmp_path, template, as_file)
    text = "what is 3 + 4?"
    ours = load_tokenizer(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    expected = theirs.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                          add_generation_prompt=True)["input_ids"]
    assert ours.encode_prompt(text) == expected
    specials = {ours.tok.token_to_id(t) for t in ("<s>", "<|im_start|>")}
    assert specials & set(ours.encode_prompt(text))  # the template's special tokens are tokens, not their text
    plain = load_tokenizer(tmp_path, chat_template=False)
    assert plain.encode_prompt(text) == [ours.bos_id, *ours.encode(text)]


def test_chat_template_errors_name_the_problem(tmp_path: Path) -> None:
    write_chat_tokenizer(tmp_path, None)
    assert load_tokenizer(tmp_path).chat_template is None
    with pytest.raises(ValueError, match="chat_template is true but .* has none"):
        load_tokenizer(tmp_path, chat_template=True)
    write_chat_tokenizer(tmp_path, 42)
    with pytest.raises(ValueError, match="chat_template must be a string or a list"):
        load_tokenizer(tmp_path)
    write_chat_tokenizer(tmp_path, "{{ raise_exception('system messages only') }}")
    with pytest.raises(ValueError, match="the chat template failed on a prompt: .*system messages only"):
        load_tokenizer(tmp_path).encode_prompt("hi")
    write_chat_tokenizer(tmp_path, "{% for %}")
    with pytest.raises(ValueError, match="the chat template failed"):
        load_tokenizer(tmp_path).encode_prompt("hi")


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<s></s>\n{% endif %}{% endif %}")


def test_template_variables_and_generation_stop_ids(tmp_path: Path) -> None:
    """chat_template kwargs reach the template as in transformers (Qwen3's enable_thinking); responses stop at eos
    and at generation_config.json's eos ids, each once."""
    from transformers import AutoTokenizer

    write_chat_tokenizer(tmp_path, THINKING)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    message = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = theirs.apply_chat_template(message, tokenize=True, add_generation_prompt=True,
                                              **kwargs)["input_ids"]
        assert load_tokenizer(tmp_path, template_kwargs=kwargs).encode_prompt("hi") == expected
    assert load_tokenizer(tmp_path, template_kwargs={"enable_thinking": False}).render_prompt("hi").endswith(
        "assistant\n<s></s>\n")

    tok = load_tokenizer(tmp_path)
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert tok.stop_ids == [tok.eos_id]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, tok.eos_id]}))
    assert load_tokenizer(tmp_path).stop_ids == [tok.eos_id, im_end]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert load_tokenizer(tmp_path).stop_ids == [tok.eos_id, im_end]
    for bad in ("2", [1, -1], [10**6], True):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
            load_tokenizer(tmp_path)
    assert CharTokenizer().stop_ids == [CharTokenizer().eos_id]


def test_an_unk_token_missing_from_the_vocabulary_is_refused_at_load(tmp_path: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "hello": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"tokenizer.json: the tokenizer model's unk_token '\[UNK\]' is not in its "
                                         r"vocabulary"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("key", ["eos_token", "bos_token", "pad_token"])
def test_a_configured_special_token_missing_from_the_vocabulary_is_refused(tmp_path: Path, key: str) -> None:
    """Before, a missing eos fell back to '</s>' silently, and responses stopped at a token the model never learnt
    to end with."""
    write_word_tokenizer(tmp_path, with_config=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, key: "<|end|>"}))
    with pytest.raises(ValueError, match=rf"tokenizer_config.json: {key} '<\|end\|>' is not in the vocabulary of "
                                         r"tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("template", [CHATML, INST], ids=["chatml", "inst"])
def test_env_replies_render_as_the_next_user_turn(tmp_path: Path, template: str) -> None:
    """A multi-turn reply's ids continue the policy's turn as the template renders a conversation: the ids of
    [user q, assistant a] + the reply equal the template's ids of [user q, assistant a, user reply] with the
    generation prompt (ChatML: from the assistant's <|im_end|> on)."""
    write_chat_tokenizer(tmp_path, template)
    ours = load_tokenizer(tmp_path)
    history = [{"role": "user", "content": "what is 3 + 4?"}, {"role": "assistant", "content": "answer"}]
    whole = ours._render([*history, {"role": "user", "content": "lower"}], generation_prompt=True)
    before = whole[: whole.index("answer") + len("answer")]
    assert ours.encode(before) + ours.encode_reply("lower") == ours.encode(whole)
    if template == CHATML:
        assert ours.encode_reply("lower")[0] == ours.tok.token_to_id("<|im_end|>")
    assert CharTokenizer().encode_reply("lower\n") == CharTokenizer().encode("lower\n")
