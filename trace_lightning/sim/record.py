"""Writing one recorded site into the packed record tensor: the reference for kernels.write_record_slot.

The rollout's recorder calls this once per recorded (layer, site) and forward, with the quantizer's outputs
flattened to one row per token: the slot (guidance/layout.py) gets the row global scales' bytes, then the block
scale bytes, then either the packed codes or their mantissa bits packed 8 per byte.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trace_lightning.sim.quantize import pack_parity


def write_record_slot(data: Tensor, tokens: Tensor, packed: Tensor, scale_bytes: Tensor, global_scale: Tensor | None,
                      offset: int, parity: bool) -> None:
    """Write M tokens' slots into data uint8 [..., width] (contiguous) at token rows `tokens` (M,) of data viewed as
    [-1, width], bytes offset .. offset + size: global_scale float32 [M, G] (or None), scale_bytes uint8 [M, NS],
    packed uint8 [M, NP] (NP % 4 == 0 with parity: 4 code bytes hold 8 elements)."""
    payload = pack_parity(packed) if parity else packed
    parts = [scale_bytes, payload]
    if global_scale is not None:
        parts.insert(0, global_scale.float().contiguous().view(torch.uint8))
    chunk = torch.cat(parts, dim=-1)
    data.view(-1, data.shape[-1])[tokens, offset : offset + chunk.shape[-1]] = chunk
