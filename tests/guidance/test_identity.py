"""The weights' byte digest: exact (an independent numpy oracle), order-sensitive, the same in every process."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from trace_lightning.guidance import ModelIdentity, identity
from trace_lightning.guidance.identity import LANES, ROW_WORDS, multipliers, scan_tensors, tensor_digest
from trace_lightning.model import MoEConfig, Transformer


def oracle_digest(t: torch.Tensor) -> str:
    """The documented digest from the tensor's bytes with numpy and Python integers (no torch arithmetic)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw, dtype="<i2" if len(raw) % 2 == 0 else "u1").astype(object)
    a = multipliers().numpy().astype(object)
    sums = []
    for start in range(0, len(words), ROW_WORDS):
        row = words[start:start + ROW_WORDS]
        sums += [int(np.dot(row, a[:len(row), lane])) for lane in range(LANES)]
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}:".encode())
    h.update(b"".join(s.to_bytes(8, "little", signed=True) for s in sums))
    return h.hexdigest()


def test_multipliers_are_nonzero_distinct_per_lane_and_below_2_31() -> None:
    a = multipliers()
    assert a.shape == (ROW_WORDS, LANES) and a.dtype == torch.int64
    assert int(a.min()) >= 1 and int(a.max()) < 2**31
    for lane in range(LANES):
        assert a[:, lane].unique().numel() == ROW_WORDS


@pytest.mark.parametrize(("dtype", "numel"), [(torch.float32, 3 * ROW_WORDS // 2 + 5), (torch.bfloat16, 2 * ROW_WORDS),
                                              (torch.float16, 7), (torch.float64, 11), (torch.uint8, 9),
                                              (torch.int64, ROW_WORDS + 1)])
def test_digest_equals_the_numpy_oracle(dtype: torch.dtype, numel: int) -> None:
    g = torch.Generator().manual_seed(numel)
    if dtype.is_floating_point:
        t = (torch.randn(numel, generator=g) * 1e3).to(dtype)
    else:
        t = torch.randint(0, 250, (numel,), generator=g).to(dtype)
    assert tensor_digest(t) == oracle_digest(t)


def test_extreme_words_do_not_overflow_the_row_sums() -> None:
    """Every word at -2^15 and at 2^15-1: the largest row sums, still exact (the oracle uses Python integers)."""
    for word in (-(2**15), 2**15 - 1):
        t = torch.full((2 * ROW_WORDS,), word, dtype=torch.int16)
        assert tensor_digest(t) == oracle_digest(t)


def test_the_gemm_path_and_the_products_path_give_the_same_integers() -> None:
    """The CPU's float64 GEMM and the GPU's int64 products, both run here, on random and on extreme words."""
    g = torch.Generator().manual_seed(3)
    for rows in (torch.randint(-(2**15), 2**15, (3, ROW_WORDS), generator=g, dtype=torch.int16),
                 torch.full((2, ROW_WORDS), -(2**15), dtype=torch.int16), torch.full((1, 77), 2**15 - 1,
                                                                                    dtype=torch.int16),
                 torch.randint(0, 256, (1, 1001), generator=g, dtype=torch.uint8)):
        assert torch.equal(identity._gemm_summed(rows), identity._products_summed(rows))


def test_equal_bytes_give_equal_digests_whatever_the_storage() -> None:
    t = torch.randn(64, 96)
    base = torch.randn(10, 64, 96)
    base[3] = t
    assert tensor_digest(t) == tensor_digest(t.clone()) == tensor_digest(base[3])  # offset into another storage
    assert tensor_digest(t.t().contiguous().t()) == tensor_digest(t)  # a column-major copy holds the same values


def test_dtype_shape_and_signed_zero_are_part_of_the_identity() -> None:
    t = torch.randn(8, 12)
    assert tensor_digest(t) != tensor_digest(t.reshape(12, 8))
    assert tensor_digest(t) != tensor_digest(t.view(torch.int32))
    assert tensor_digest(torch.zeros(4)) != tensor_digest(-torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_bit_flip_changes_the_digest(dtype: torch.dtype) -> None:
    t = torch.randn(ROW_WORDS + 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = tensor_digest(t)
    bits = t.element_size() * 8
    words = t.view(torch.int16 if bits == 16 else torch.int32)
    for index in (0, 1, ROW_WORDS // 2, ROW_WORDS - 1, ROW_WORDS, t.numel() - 1):
        for bit in range(bits):
            flipped = words.clone()
            flipped[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(flipped.dtype) if bit < bits - 1 \
                else torch.iinfo(flipped.dtype).min
            assert tensor_digest(flipped.view(dtype)) != before, (index, bit)


def test_row_swaps_change_the_digest_when_the_row_length_is_a_multiple_of_7() -> None:
    """Sums and every-7th-element sums keep every such permutation; the byte digest keeps none."""
    emb = torch.randn(50, 14 * 9, generator=torch.Generator().manual_seed(1))
    before = tensor_digest(emb)
    for i, j in [(0, 1), (0, 7), (3, 10), (48, 49), (0, 49)]:
        swapped = emb.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert tensor_digest(swapped) != before, (i, j)
    assert tensor_digest(emb[torch.randperm(50, generator=torch.Generator().manual_seed(2))]) != before


def test_swapping_two_words_inside_a_row_changes_the_digest() -> None:
    t = torch.arange(ROW_WORDS, dtype=torch.int16)
    before = tensor_digest(t)
    for i, j in [(0, 1), (5, 12), (0, ROW_WORDS - 1), (100, 7 * 1000)]:
        swapped = t.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert tensor_digest(swapped) != before, (i, j)


def swap_experts(model: Transformer, layer: int, i: int, j: int) -> None:
    """The same function with experts i and j of one layer exchanged (router rows, w13 and w2 alike)."""
    moe = model.layers[layer].moe
    with torch.no_grad():
        for p in (moe.router.weight, moe.experts.w13, moe.experts.w2):
            p[[i, j]] = p[[j, i]]


def test_swapping_two_experts_consistently_changes_the_model_identity() -> None:
    torch.manual_seed(0)
    config = MoEConfig.from_name("debug-moe", n_layers=2)
    model = Transformer(config)
    before = ModelIdentity.of(config, model.state_dict())
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    logits = model(tokens)
    swap_experts(model, 1, 0, 7)  # indices that agree mod 7
    torch.testing.assert_close(model(tokens), logits)  # the same model to its outputs: only the identity differs
    after = ModelIdentity.of(config, model.state_dict())
    assert after.fingerprint != before.fingerprint
    swap_experts(model, 1, 0, 7)
    assert ModelIdentity.of(config, model.state_dict()) == before


def test_the_digest_is_the_same_in_another_process() -> None:
    code = ("import torch; from trace_lightning.guidance.identity import tensor_digest; "
            "print(tensor_digest(torch.randn(3, 70000, generator=torch.Generator().manual_seed(5))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == tensor_digest(torch.randn(3, 70000, generator=torch.Generator().manual_seed(5)))


def test_the_scan_flags_non_finite_tensors_by_name() -> None:
    named = {"ok": torch.randn(5), "nan": torch.tensor([1.0, float("nan")]), "inf": torch.tensor([-float("inf")]),
             "half": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), "ints": torch.arange(3),
             "empty": torch.zeros(0)}
    digests, finite = scan_tensors(named)
    assert finite == {"ok": True, "nan": False, "inf": False, "half": False, "ints": True, "empty": True}
    assert digests == {name: oracle_digest(t) for name, t in named.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digest_equals_the_cpu_digest() -> None:
    named = {"big": torch.randn(3, ROW_WORDS * 5 + 3), "bf16": torch.randn(257, 33).bfloat16(),
             "bytes": torch.randint(0, 255, (1001,), dtype=torch.uint8)}
    on_gpu = {name: t.cuda() for name, t in named.items()}
    assert scan_tensors(on_gpu) == scan_tensors(named)
