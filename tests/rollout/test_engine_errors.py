"""Bad input to the engine is refused with an error naming what is wrong, and a refused update changes nothing."""

import math

import numpy as np
import pytest
import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import Engine, FP4Precision, SamplingParams

from .conftest import PROMPTS

FP4 = FP4Precision(fmt="nvfp4")


def _engine(model: Transformer, precision: FP4Precision | str = FP4) -> Engine:
    return Engine(model, precision, backend="sim")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (lambda: SamplingParams(max_new_tokens=2.0), r"max_new_tokens must be an integer or one .*, got 2\.0"),
        (lambda: SamplingParams(max_new_tokens=[2, 2, 2.5, 2]), r"max_new_tokens\[2\] must be an integer"),
        (lambda: SamplingParams(max_new_tokens=True), "max_new_tokens must be an integer or one integer per prompt"),
        (lambda: SamplingParams(seed=1.5), r"seed must be an integer or one integer per prompt, got 1\.5"),
        (lambda: SamplingParams(seed=[0, 1, None, 3]), r"seed\[2\] must be an integer, got None"),
        (lambda: SamplingParams(stop_token_ids=[None]), r"stop token id None is not an id in \[0, 128\)"),
        (lambda: SamplingParams(stop_token_ids=[True]), r"stop token id True is not an id"),
        (lambda: SamplingParams(stop_token_ids=[2.0]), r"stop token id 2\.0 is not an id"),
    ],
    ids=["float_max_new", "float_in_list", "bool_max_new", "float_seed", "none_seed", "none_stop", "bool_stop",
         "float_stop"],
)
def test_bad_sampling_values_are_value_errors(model: Transformer, params, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        _engine(model, "fp32").generate(PROMPTS, params())


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -0.5])
def test_non_finite_or_negative_temperature_is_refused(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([[1, True, 3]], r"prompt 0: token True at position 1 is not an id"),
        ([[1, 2.0]], r"prompt 0: token 2\.0 at position 1 is not an id"),
        ([[1, 2], [1, None]], r"prompt 1: token None at position 1"),
        ([[1, 200]], r"prompt 0: token 200 at position 1 is not an id in \[0, 128\)"),
        ([[1, 2], []], "prompt 1 is empty"),
        (["hello"], "prompt 0 must be a list of token ids, got 'hello'"),
        ([], "non-empty list of prompts"),
    ],
)
def test_bad_prompts_name_the_prompt_and_position(model: Transformer, prompts: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _engine(model, "fp32").generate(prompts, SamplingParams(max_new_tokens=2))


def test_numpy_and_tensor_integers_are_token_ids_like_python_ints(model: Transformer) -> None:
    engine = _engine(model, "fp32")
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    plain = engine.generate(PROMPTS, params)
    as_numpy = [list(np.array(p, dtype=np.int64)) for p in PROMPTS]
    numpy_params = SamplingParams(max_new_tokens=np.int32(3), temperature=0.0, seed=np.int64(0),
                                  stop_token_ids=[np.int64(127)])
    other = engine.generate(as_numpy, numpy_params)
    assert other.responses == plain.responses and other.logprobs == plain.logprobs
    assert all(type(t) is int for p in other.prompts for t in p)
    assert engine.generate([torch.tensor(p) for p in PROMPTS], params).responses == plain.responses


@pytest.mark.parametrize("precision", ["fp32", FP4], ids=["fp32", "nvfp4"])
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_by_the_engine(model: Transformer, precision: FP4Precision | str,
                                                      bad: float) -> None:
    """NaN only in k_proj used to give finite logits on CPU (attention zeroed the keys): now no engine at all."""
    with torch.no_grad():
        model.layers[1].attn.wqkv.weight[model.config.q_dim + 3, 5] = bad  # a k_proj row
    with pytest.raises(ValueError, match=r"Engine: weight 'layers\.1\.attn\.wqkv\.weight' holds 1 non-finite"):
        _engine(model, precision)


def test_generate_names_a_weight_poisoned_after_construction(model: Transformer) -> None:
    engine = _engine(model, "fp32")
    with torch.no_grad():
        engine.model.output.weight.fill_(math.nan)  # logits NaN: used to return token 0 with NaN logprobs
    with pytest.raises(ValueError, match=r"generate: weight 'output\.weight' holds \d+ non-finite"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


def _snapshot(engine: Engine) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    dense = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return engine.weight_checksums(), dense


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        (lambda t: t.to(torch.int64), r"weight 'layers\.1\.attn\.wo\.weight' has dtype torch\.int64"),
        (lambda t: t > 0, r"weight 'layers\.1\.attn\.wo\.weight' has dtype torch\.bool"),
        (lambda t: t.index_fill(0, torch.tensor([0]), math.nan), r"'layers\.1\.attn\.wo\.weight' holds 128 non-fin"),
        (lambda t: t[:, :-1], r"tensor 'layers\.1\.attn\.wo\.weight' has shape"),
    ],
    ids=["int64", "bool", "nan", "shape"],
)
def test_update_weights_is_all_or_nothing(model: Transformer, base_model: Transformer, poison,  # noqa: ANN001
                                          message: str) -> None:
    """A bad tensor after good ones used to leave the good ones written (int64 of the right shape)."""
    engine = _engine(model)
    named = {k: v.detach().clone() * 1.5 for k, v in base_model.state_dict().items()}  # every tensor changes
    before = _snapshot(engine)
    bad_key = "layers.1.attn.wo.weight"
    assert list(named).index(bad_key) > 0  # good tensors come first
    named[bad_key] = poison(named[bad_key])
    with pytest.raises(ValueError, match=message):
        engine.update_weights(named, version=1)
    after = _snapshot(engine)
    assert after[0] == before[0]
    for key, value in before[1].items():
        torch.testing.assert_close(after[1][key], value, rtol=0, atol=0)
    assert engine.policy_version == 0


def test_policy_version_never_goes_backwards(model: Transformer, base_model: Transformer) -> None:
    engine = _engine(model, "fp32")
    named = {"norm.weight": base_model.norm.weight.detach().clone()}
    engine.update_weights(named, version=5)
    engine.update_weights(named, version=np.int64(5))  # the same version again (re-sync) is fine
    for version in (4, -1, 5.5, True, None):
        with pytest.raises(ValueError, match=r"policy version .* must be an integer >= the current 5"):
            engine.update_weights(named, version=version)
    assert engine.policy_version == 5
