"""The record-slot kernel writes exactly the sim's bytes, and both are the layout's slot: row globals' IEEE bytes,
scale bytes, codes or their mantissa bits as numpy packs them; a slot never touches its neighbours' bytes."""

import numpy as np
import pytest
import torch

from trace_lightning import kernels, sim
from trace_lightning.guidance.layout import RecordLayout
from trace_lightning.quant import parse_format


@pytest.mark.parametrize("parity", [False, True], ids=["full", "parity"])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4:none", "mxfp4:rceil"])
def test_kernel_writes_the_sims_slot_bytes(device: str, fmt: str, parity: bool) -> None:
    fp4 = parse_format(fmt)
    rows, k = (3,), 64  # e.g. moe_down's top-k rows, or k / v's heads
    mode = "parity" if parity else "full"
    layout = RecordLayout.build(fp4, mode, {(0, "attn_in"): ((), 32), (0, "moe_down"): (rows, k), (1, "v"): ((2,), 32)})
    slot = layout.slot((0, "moe_down"))
    g = torch.Generator().manual_seed(3)
    q = fp4.quantize(torch.randn(2, 5, *rows, k, generator=g) * 4)  # a forward's (B, T) tokens
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    out_rows = torch.tensor([2, 0])[:, None].expand_as(positions)  # continuous batching: slot b -> sequence
    tokens = (out_rows * 12 + positions).reshape(-1)
    globals_ = None if getattr(q, "global_scale", None) is None else q.global_scale.reshape(10, -1)
    noise = torch.randint(0, 256, (3, 12, layout.width), generator=g, dtype=torch.uint8)
    ours, ref = noise.clone().to(device), noise.clone()
    kernels.write_record_slot(ours, tokens.to(device), q.packed.reshape(10, -1).to(device),
                              q.scale_bytes().reshape(10, -1).to(device),
                              None if globals_ is None else globals_.to(device), slot.offset, parity)
    sim.write_record_slot(ref, tokens, q.packed.reshape(10, -1), q.scale_bytes().reshape(10, -1), globals_,
                          slot.offset, parity)
    assert torch.equal(ours.cpu(), ref)
    written = torch.zeros(3 * 12, dtype=torch.bool)
    written[tokens] = True
    flat, before = ref.view(-1, layout.width), noise.view(-1, layout.width)
    outside = torch.ones(layout.width, dtype=torch.bool)
    outside[slot.offset : slot.end] = False
    assert torch.equal(flat[~written], before[~written]) and torch.equal(flat[:, outside], before[:, outside])
    codes = q.codes().reshape(10, -1).numpy()  # the external oracle for the payload: numpy's bit packing
    payload = flat[tokens, slot.offset + slot.global_bytes + slot.scale_bytes : slot.end].numpy()
    expected = np.packbits((codes & 1).astype(bool), axis=-1, bitorder="little") if parity else \
        q.packed.reshape(10, -1).numpy()
    assert np.array_equal(payload, expected)
    if globals_ is not None:
        head = flat[tokens, slot.offset : slot.offset + slot.global_bytes].numpy()
        assert np.array_equal(head.view(np.float32), globals_.numpy())


def test_kernel_refuses_a_slot_past_the_row(device: str) -> None:
    data = torch.zeros(2, 4, 32, dtype=torch.uint8, device=device)
    packed, scales = torch.zeros(1, 16, dtype=torch.uint8, device=device), torch.zeros(1, 2, dtype=torch.uint8,
                                                                                     device=device)
    with pytest.raises(ValueError, match="does not fit a 32-byte row"):
        kernels.write_record_slot(data, torch.zeros(1, dtype=torch.long, device=device), packed, scales, None, 20,
                                  False)
