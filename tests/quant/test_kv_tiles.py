"""The value-tile layout of the FP4 KV cache (quant/kv_tiles.py): its definition element by element, exact inverse,
and the half-word masks the append uses."""

import pytest
import torch

from trace_lightning.quant.kv_tiles import from_value_tiles, half_word_masks, to_value_tiles
from trace_lightning.quant.words import from_word_layout


def _random_cache(lead: tuple[int, ...], S: int, dh: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, S, dh // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 256, (*lead, S, dh // 16), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return packed, scales


def test_layout_matches_its_definition_element_by_element() -> None:
    packed, scales = _random_cache((2,), 32, 64)
    tiled, tiled_scales = to_value_tiles(packed, scales)
    assert tiled.shape == packed.shape and tiled_scales.shape == scales.shape
    words = from_word_layout(tiled).view(2, -1)  # bytes back from the word bits, [seq, S * Dh / 2]
    sbytes, tbytes = scales.view(torch.uint8), tiled_scales.view(torch.uint8).reshape(2, -1)
    nb = 64 // 16

    def code(s: int, key: int, d: int) -> int:
        return int(packed[s, key, d // 2] >> (4 * (d % 2))) & 15

    for s in range(2):
        for key in range(32):
            T, q, t, p = key // 16, key % 16 // 8, key % 8 // 2, key % 2
            for d in range(64):
                g, c, i = d // 16, d % 16 // 4, d % 4
                byte = (((T * 2 + q) * nb + g) * 4 + t) * 16 + c * 4 + i
                assert (int(words[s, byte]) >> (4 * p)) & 15 == code(s, key, d)
            for g in range(nb):
                assert tbytes[s, T * 16 * nb + ((g * 4 + t) * 2 + q) * 2 + p] == sbytes[s, key, g]


@pytest.mark.parametrize("lead,S,dh", [((3, 2), 48, 128), ((1,), 16, 16)])
def test_inverse_is_exact(lead: tuple[int, ...], S: int, dh: int) -> None:
    packed, scales = _random_cache(lead, S, dh, seed=S)
    back, back_scales = from_value_tiles(*to_value_tiles(packed, scales))
    assert torch.equal(back, packed) and torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))


def test_rejects_lengths_that_do_not_split_into_tiles() -> None:
    packed, scales = _random_cache((1,), 24, 64)
    with pytest.raises(ValueError, match="S % 16"):
        to_value_tiles(packed, scales)


def test_half_word_masks_split_every_word_between_the_two_keys() -> None:
    lo, hi = half_word_masks()
    assert lo & hi == 0 and (lo | hi) & 0xFFFFFFFF == 0xFFFFFFFF
    assert bin(lo & 0xFFFFFFFF).count("1") == 16
    # the even key of a pair (low nibbles) owns exactly the bits its codes land on, the odd key the others
    packed, scales = _random_cache((1,), 16, 16)
    even, odd = packed.clone(), packed.clone()
    even[:, 1::2], odd[:, 0::2] = 0, 0
    assert not (to_value_tiles(even, scales)[0].view(torch.int32) & ~lo).any()
    assert not (to_value_tiles(odd, scales)[0].view(torch.int32) & ~hi).any()
