"""Malformed Hugging Face checkpoints: every bad file gives an error naming it, before anything large is built."""

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from trace_lightning.model import CheckpointError, MoEConfig, Transformer, config_from_hf, load_hf, save_hf
from trace_lightning.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3-MoE checkpoint in the hub layout, with a tokenizer beside it."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("good")
    save_hf(Transformer(MoEConfig.from_name("debug-moe", n_layers=2, vocab_size=128)), path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def _copy(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst, dirs_exist_ok=True)
    return dst


def _edit_config(good: Path, dst: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    _copy(good, dst)
    config = json.loads((good / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(edit(config)))
    return dst


def _edit_weights(good: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    _copy(good, dst)
    with safe_open(str(good / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_the_fixture_loads(good: Path) -> None:
    assert load_hf(good).config.n_layers == 2
    assert load_tokenizer(good).bos_id == 1


def _without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: [c], "a config must be a JSON object, got list"),
        (lambda c: "Qwen3MoeForCausalLM", "a config must be a JSON object, got str"),
        (lambda c: c | {"architectures": "Qwen3MoeForCausalLM"}, "'architectures' must be a list of names"),
        (lambda c: c | {"architectures": [None]}, "'architectures' must be a list of names"),
        (lambda c: _without(c, "head_dim") | {"num_attention_heads": 0}, "malformed config|must be positive"),
        (lambda c: c | {"hidden_size": "128"}, "malformed config|dim must be an integer"),
        (lambda c: c | {"num_hidden_layers": None}, "malformed config|n_layers must be an integer"),
        (lambda c: c | {"num_experts_per_tok": 2.5}, r"num_experts_per_tok.* expected int, got float"),
        (lambda c: c | {"tie_word_embeddings": "no"}, r"tie_word_embeddings.* expected bool"),
        (lambda c: c | {"rms_norm_eps": -1e-6}, r"norm_eps must be a finite number > 0, got -1e-06"),
        (lambda c: c | {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
         r"rope_theta must be a finite number > 0, got -1\.0"),
        (lambda c: c | {"num_local_experts": 10**9}, r"n_experts must be <= 32768"),
        (lambda c: c | {"num_local_experts": 20000}, r"declares [\d,]+ parameters .*20000 experts.* hold [\d,]+"),
        (lambda c: c | {"num_hidden_layers": 10**6}, r"declares [\d,]+ parameters \(1000000 layers"),
    ],
    ids=["list", "string", "arch-string", "arch-null", "zero-heads", "string-dim", "null-layers", "float-topk",
         "string-bool", "negative-eps", "negative-theta", "1e9-experts", "20000-experts", "1e6-layers"],
)
def test_malformed_config_names_config_json(good: Path, tmp_path: Path, edit, message: str) -> None:  # noqa: ANN001
    path = _edit_config(good, tmp_path, edit)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=message) as err:
        load_hf(path)
    assert "config.json" in str(err.value) and "\n" not in str(err.value)
    assert time.perf_counter() - start < 10  # refused before building anything of the declared size


@pytest.mark.parametrize("content", ["{not json", "", "\x00\x01"], ids=["broken", "empty", "binary"])
def test_unparseable_config_json_is_named(good: Path, tmp_path: Path, content: str) -> None:
    _copy(good, tmp_path)
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        config_from_hf(tmp_path)


def test_a_fifo_as_config_json_is_refused_without_hanging(good: Path, tmp_path: Path) -> None:
    _copy(good, tmp_path)
    (tmp_path / "config.json").unlink()
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json is not a regular file"):
        config_from_hf(tmp_path)


def _sharded(good: Path, dst: Path, weight_map: Any) -> Path:
    _copy(good, dst)
    (dst / "model.safetensors").rename(dst / "shard-1.safetensors")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_index_shards_outside_the_checkpoint_are_refused(good: Path, tmp_path: Path) -> None:
    with safe_open(str(good / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(good / "model.safetensors", outside)  # a real, readable file: only the path is wrong
    for shard in ("../outside.safetensors", str(outside), "sub/../../outside.safetensors"):
        path = _sharded(good, tmp_path / "ckpt", dict.fromkeys(keys, shard))
        with pytest.raises(CheckpointError, match=r"index\.json: shard .* lies outside the checkpoint folder"):
            load_hf(path)
    path = _sharded(good, tmp_path / "ok", dict.fromkeys(keys, "shard-1.safetensors"))
    assert load_hf(path).config.n_layers == 2  # a proper index still loads


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": ["shard-1.safetensors"]}, "'weight_map' must be an object"),
        ({"weight_map": {"lm_head.weight": 3}}, "'weight_map' must be an object"),
        ({"metadata": {}}, "'weight_map' must be an object"),
        ([], "must be a JSON object"),
        ("{broken", "cannot read"),
    ],
)
def test_malformed_index_is_named(good: Path, tmp_path: Path, index: Any, message: str) -> None:
    _copy(good, tmp_path)
    text = index if isinstance(index, str) else json.dumps(index)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=message) as err:
        load_hf(tmp_path)
    assert "model.safetensors.index.json" in str(err.value)


KEY = "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        (lambda t: t.round().to(torch.int64), rf"tensor '{KEY}' has dtype torch\.int64; weights must be floating"),
        (lambda t: t > 0, rf"tensor '{KEY}' has dtype torch\.bool"),
        (lambda t: t.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(math.nan)),
         rf"tensor '{KEY}' holds 1 non-finite"),
        (lambda t: t.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(-math.inf)),
         rf"tensor '{KEY}' holds 1 non-finite"),
        (lambda t: t.index_put((torch.tensor([2]), torch.tensor([1])), torch.tensor(math.nan)).to(torch.float8_e4m3fn),
         rf"tensor '{KEY}' holds 1 non-finite \(NaN or inf\) values \(dtype torch\.float8_e4m3fn\)"),
        (lambda t: t.index_put((torch.tensor([1]), torch.tensor([1])), torch.tensor(math.inf)).to(torch.float8_e5m2),
         rf"tensor '{KEY}' holds 1 non-finite \(NaN or inf\) values \(dtype torch\.float8_e5m2\)"),
    ],
    ids=["int64", "bool", "nan", "-inf", "float8-nan", "float8-inf"],
)
def test_bad_weight_values_name_the_tensor(good: Path, tmp_path: Path, poison, message: str) -> None:  # noqa: ANN001
    path = _edit_weights(good, tmp_path, lambda s: s.update({KEY: poison(s[KEY])}))
    with pytest.raises(CheckpointError, match=message):
        load_hf(path)


def test_finite_float8_weights_load_as_their_values(good: Path, tmp_path: Path) -> None:
    """isfinite has no float8 kernel: the check widens the tensor instead of failing unnamed, and the values load."""
    stored = {}

    def to_float8(state: dict) -> None:
        stored["w"] = state[KEY].to(torch.float8_e4m3fn)
        state[KEY] = stored["w"]

    model = load_hf(_edit_weights(good, tmp_path, to_float8))
    k_rows = model.layers[1].attn.wqkv.weight[model.config.q_dim : model.config.q_dim + model.config.kv_dim]
    torch.testing.assert_close(k_rows, stored["w"].float(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("tokenizer.json", "{broken", r"cannot read tokenizer .*tokenizer\.json"),
        ("tokenizer.json", '{"model": 5}', r"cannot read tokenizer .*tokenizer\.json"),
        ("tokenizer.json", "[]", r"cannot read tokenizer .*tokenizer\.json"),
        ("tokenizer_config.json", "{broken", r"cannot read .*tokenizer_config\.json"),
        ("tokenizer_config.json", '["<s>"]', r"tokenizer_config\.json: a tokenizer config must be a JSON object"),
        ("tokenizer_config.json", "null", r"tokenizer_config\.json: a tokenizer config must be a JSON object"),
    ],
)
def test_malformed_tokenizer_files_are_named(good: Path, tmp_path: Path, file: str, content: str,
                                             message: str) -> None:
    _copy(good, tmp_path)
    (tmp_path / file).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_fifos_are_refused_without_hanging(good: Path, tmp_path: Path, file: str) -> None:
    _copy(good, tmp_path)
    (tmp_path / file).unlink()
    os.mkfifo(tmp_path / file)
    with pytest.raises(ValueError, match=rf"{file.replace('.', '[.]')}.* regular file"):
        load_tokenizer(tmp_path)
