"""Tokenizers behind one small interface: a built-in character tokenizer for the CPU simulator tasks
(fits debug-moe's 128-token vocab, needs no files) and a wrapper over a local ``tokenizer.json``.

A task prompt becomes ids through ``encode_prompt``: a checkpoint's chat template, where it has one, renders it as
a user turn followed by the assistant's generation prompt (how instruct models were trained to read a request, and
what RL frameworks feed them); otherwise bos + the text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from trace_lightning.model.checkpoint_files import read_json_file

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
MAX_TOKENIZER_BYTES = 1 << 30
MAX_TEMPLATE_BYTES = 1 << 20


class Tokenizer(Protocol):
    """What envs, rollout and training need from a tokenizer."""

    pad_id: int
    bos_id: int | None
    eos_id: int | None
    vocab_size: int

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_reply(self, text: str) -> list[int]:
        """An environment's reply in a multi-turn episode: the tokens that follow the policy's turn."""
        ...

    @property
    def stop_ids(self) -> list[int]:
        """The ids a response ends at: eos, and a checkpoint's other end-of-generation ids."""
        ...


class CharTokenizer:
    """<pad>=0, <bos>=1, <eos>=2, then tab, newline and printable ASCII (space..~): 100 ids."""

    specials = (PAD, BOS, EOS)
    chars = "\t\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = len(self.specials) + len(self.chars)
        self._ids = {ch: i + len(self.specials) for i, ch in enumerate(self.chars)}
        self._text = ["" for _ in self.specials] + list(self.chars)  # id -> text, a table lookup per token
        self._text_with_specials = [*self.specials, *self.chars]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self.bos_id] if bos else []
        for pos, ch in enumerate(text):
            if ch not in self._ids:
                raise ValueError(f"CharTokenizer cannot encode {ch!r} at position {pos} (only printable ASCII)")
            ids.append(self._ids[ch])
        return ids + [self.eos_id] if eos else ids

    def encode_prompt(self, text: str) -> list[int]:
        """bos + the text."""
        return self.encode(text, bos=True)

    def encode_reply(self, text: str) -> list[int]:
        """The text as it is: a conversation without a template is plain text."""
        return self.encode(text)

    @property
    def stop_ids(self) -> list[int]:
        return [self.eos_id]

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        text = self._text if skip_special else self._text_with_specials
        return "".join([text[i] for i in ids])


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a local file; specials and the chat template from tokenizer_config.json (or
    chat_template.jinja) when beside it.

    chat_template: render prompts with the chat template (True: one must exist), never (False), or where there is
    one (None); template_kwargs: extra variables the template reads (e.g. Qwen3's ``enable_thinking``).
    Responses stop at eos and at generation_config.json's ``eos_token_id`` (one id or a list), as vLLM's do."""

    def __init__(self, path: str | Path, chat_template: bool | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tok = _read_tokenizer(file, _Tokenizer)
        specials = _special_tokens(file.parent / "tokenizer_config.json")
        self._check_specials_in_vocab(file, specials)
        self.bos_id = self._id(specials.get("bos_token"), (BOS, "<s>", "<|endoftext|>"))
        self.eos_id = self._id(specials.get("eos_token"), (EOS, "</s>", "<|endoftext|>", "<|im_end|>"))
        pad = self._id(specials.get("pad_token"), (PAD, "<unk>"))
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.specials = specials
        template = _chat_template(file.parent) if chat_template is not False else None
        if chat_template and template is None:
            raise ValueError(f"chat_template is true but {file.parent} has none (no 'chat_template' in "
                             "tokenizer_config.json, no chat_template.jinja)")
        self.chat_template: str | None = template
        self.template_kwargs = dict(template_kwargs or {})
        self._chat: Any = None
        ends = [] if self.eos_id is None else [self.eos_id]
        self._stop_ids = list(dict.fromkeys(ends + _generation_eos(file.parent / "generation_config.json",
                                                                   self.vocab_size)))

    def _check_specials_in_vocab(self, file: Path, specials: dict[str, str]) -> None:
        """The model's unk token and tokenizer_config.json's bos/eos/pad tokens must be in the vocabulary: a missing
        unk fails at the first unknown piece of an encode, and a missing eos would be replaced by a fallback token
        responses then never stop at."""
        unk = getattr(self.tok.model, "unk_token", None)
        if isinstance(unk, str) and self.tok.token_to_id(unk) is None:
            raise ValueError(f"{file}: the tokenizer model's unk_token {unk!r} is not in its vocabulary (encoding "
                             "an unknown piece would fail); add the token or set unk_token to null")
        for key, token in specials.items():
            if self.tok.token_to_id(token) is None:
                raise ValueError(f"{file.parent / 'tokenizer_config.json'}: {key} {token!r} is not in the vocabulary "
                                 f"of {file.name}")

    def _id(self, configured: str | None, fallbacks: tuple[str, ...]) -> int | None:
        for token in (configured, *fallbacks):
            if token is not None and (i := self.tok.token_to_id(token)) is not None:
                return i
        return None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no bos token")
            ids = [self.bos_id, *ids]
        if eos:
            if self.eos_id is None:
                raise ValueError("this tokenizer has no eos token")
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def stop_ids(self) -> list[int]:
        return list(self._stop_ids)

    def encode_prompt(self, text: str) -> list[int]:
        """The chat template's user turn holding `text` and the generation prompt (special tokens in the rendered
        text read as themselves); without a template, bos (if any) + the text."""
        if self.chat_template is None:
            return self.encode(text, bos=self.bos_id is not None)
        return self.encode(self.render_prompt(text))

    def encode_reply(self, text: str) -> list[int]:
        """An environment's reply to the policy's turn, as the chat template renders it: what the template puts
        after an assistant message's content when a user message holding `text` and the generation prompt follow
        (ChatML: "<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"). The assistant's
        end-of-turn token leads it; the rollout drops it where the policy already sampled it. Without a template, the
        plain text."""
        if self.chat_template is None:
            return self.encode(text)
        mark = "\x00ASSISTANT\x00"
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}]
        full = self._render([*history, {"role": "user", "content": text}], generation_prompt=True)
        if full.count(mark) != 1:
            raise ValueError("the chat template does not render an assistant message's content once; it cannot "
                             "place an environment's reply")
        return self.encode(full[full.index(mark) + len(mark):])

    def render_prompt(self, text: str) -> str:
        """The chat template rendered for one user message, ending where the assistant's reply begins (Hugging
        Face's own sandboxed renderer, so templates behave as in transformers)."""
        return self._render([{"role": "user", "content": text}], generation_prompt=True)

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if self._chat is None:
            from transformers import PreTrainedTokenizerFast

            self._chat = PreTrainedTokenizerFast(tokenizer_object=self.tok, **self.specials)
        try:
            return self._chat.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.template_kwargs)
        except Exception as e:  # noqa: BLE001  (jinja raises its own types, and templates call raise_exception)
            raise ValueError(f"the chat template failed on a prompt: {type(e).__name__}: {e}") from e


def _read_tokenizer(file: Path, cls: Any) -> Any:
    """A ``tokenizers.Tokenizer`` from a regular file; ValueError naming the file for anything else, including
    the Rust panics (``PanicException`` is a BaseException) that some malformed files raise."""
    if not file.is_file() or file.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"cannot read tokenizer {file}: not a regular file of at most {MAX_TOKENIZER_BYTES} bytes")
    try:
        return cls.from_file(str(file))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # tokenizers raises its own exception types, and panics
        raise ValueError(f"cannot read tokenizer {file}: {type(e).__name__}: {e}") from e


def _special_tokens(file: Path) -> dict[str, str]:
    """bos/eos/pad token strings from a tokenizer_config.json (strings or {"content": ...} dicts)."""
    if not file.exists():
        return {}
    raw = read_json_file(file, "tokenizer config")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def _chat_template(folder: Path) -> str | None:
    """The default chat template beside a tokenizer: chat_template.jinja, or tokenizer_config.json's chat_template
    (a string, or a list of {"name", "template"} whose "default" entry is taken)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{jinja}: {jinja.stat().st_size} bytes is too large for a chat template "
                             f"(limit {MAX_TEMPLATE_BYTES})")
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read chat template {jinja}: {e}") from e
    file = folder / "tokenizer_config.json"
    raw = read_json_file(file, "tokenizer config").get("chat_template") if file.exists() else None
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{file}: chat_template must be a string or a list holding a 'default' template, "
                     f"got {type(raw).__name__}")


def _generation_eos(file: Path, vocab_size: int) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list of ids), [] where there is none."""
    if not file.exists():
        return []
    raw = read_json_file(file, "generation config").get("eos_token_id")
    ids = [] if raw is None else raw if isinstance(raw, list) else [raw]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of ids in [0, {vocab_size}), got {raw!r}")
    return ids


def load_tokenizer(path: str | Path, chat_template: bool | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> HFTokenizer:
    """A local tokenizer.json, or a folder holding one (as Hugging Face checkpoints do)."""
    return HFTokenizer(path, chat_template, template_kwargs)
