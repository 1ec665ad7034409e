"""``trace-export`` as a tool: exit 0 and the folder on stdout, a one-line error and exit 2 for a bad source, and
an output folder that transformers' own readers load (tokenizer, config with bos / eos, generation config)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3MoeConfig

from trace_lightning.export import main
from trace_lightning.model import CharTokenizer, MoEConfig, Transformer, load_hf
from trace_lightning.serving_files import char_tokenizer_object

ROOT = Path(__file__).resolve().parents[2]
TEXT = "What is 12 * 3?\n\tAnswer: 36."


def fit_checkpoint(path: Path, fmt: str = "mxfp4") -> Transformer:
    """A trace-rl fit checkpoint of debug-moe (built-in tokenizer) with weights a fresh init would not give."""
    torch.manual_seed(0)
    debug = Transformer(MoEConfig.from_name("debug-moe"))
    with torch.no_grad():
        debug.tok_embeddings.weight.mul_(3.0)
    torch.save({"state_dict": {f"policy.{k}": v for k, v in debug.state_dict().items()},
                "hyper_parameters": {"model": "debug-moe", "checkpoint": None, "trace": {"fmt": fmt}}}, path)
    return debug


def hf_folder(path: Path) -> Path:
    """A tiny Qwen3-MoE checkpoint whose tokenizer ends turns at <|im_end|> and also stops at <|endoftext|>."""
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *map(chr, range(32, 125))])}
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in list(vocab)[:3]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


def test_exit_0_and_the_folder_once_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fit_checkpoint(tmp_path / "fit.ckpt")
    assert main([str(tmp_path / "fit.ckpt"), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'out'}\n"
    assert str(tmp_path / "out") not in captured.err


def test_console_script_exits_0(tmp_path: Path) -> None:
    """The installed entry point as the shell runs it: ``sys.exit(main())``."""
    fit_checkpoint(tmp_path / "fit.ckpt")
    code = ("import sys; from importlib.metadata import entry_points; "
            "sys.exit(entry_points(group='console_scripts')['trace-export'].load()(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fit.ckpt"), str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{tmp_path / 'out'}\n"
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p / "missing.ckpt", "missing.ckpt: no such checkpoint file or Hugging Face folder"),
    (lambda p: (p / "junk.ckpt").write_bytes(b"not a checkpoint at all") and p / "junk.ckpt",
     "junk.ckpt: not a trace-rl checkpoint"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "missing config: no config.json in"),
])
def test_a_bad_source_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], make,
                                             message: str) -> None:
    source = make(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("trace-export: error: ") and message in err
    assert err.count("\n") == 1


def test_a_preset_checkpoint_exports_the_builtin_tokenizer(tmp_path: Path) -> None:
    debug = fit_checkpoint(tmp_path / "fit.ckpt")
    main([str(tmp_path / "fit.ckpt"), str(tmp_path / "out")])
    out = tmp_path / "out"
    assert torch.equal(load_hf(out).tok_embeddings.weight, debug.tok_embeddings.weight)
    tokenizer = AutoTokenizer.from_pretrained(out)
    char = CharTokenizer()
    assert tokenizer(TEXT)["input_ids"] == char.encode_prompt(TEXT)  # bos + characters, as the policy was trained
    assert tokenizer.decode(char.encode(TEXT, bos=True, eos=True), skip_special_tokens=True) == TEXT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    config = AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.quantization_config["format"] == "mxfp4-pack-quantized"
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


def test_an_hf_folder_exports_its_own_tokenizer_and_stop_ids(tmp_path: Path) -> None:
    source = hf_folder(tmp_path / "src")
    main([str(source), str(tmp_path / "out"), "--fmt", "nvfp4"])
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("abc xyz")["input_ids"]) == "abc xyz"
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 0)
    config = AutoConfig.from_pretrained(out)
    assert (config.eos_token_id, config.pad_token_id) == (2, 0)
    assert config.bos_token_id is None or config.bos_token_id == 0  # <|endoftext|>, HFTokenizer's bos fallback
    assert GenerationConfig.from_pretrained(out).eos_token_id == [2, 0]  # the checkpoint's stop ids, kept


def test_an_hf_folder_without_a_tokenizer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = hf_folder(tmp_path / "src")
    (source / "tokenizer.json").unlink()
    with pytest.raises(SystemExit):
        main([str(source), str(tmp_path / "out")])
    assert "no tokenizer.json to export beside the weights" in capsys.readouterr().err


def test_the_builtin_tokenizer_file_encodes_as_char_tokenizer() -> None:
    char, tok = CharTokenizer(), char_tokenizer_object()
    text = "".join(char.chars)
    assert tok.encode(text, add_special_tokens=False).ids == char.encode(text)
    assert tok.encode(text).ids == char.encode_prompt(text)
    assert tok.get_vocab_size() == char.vocab_size
    assert tok.decode(char.encode(text, eos=True)) == text
