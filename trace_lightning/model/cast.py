"""A model run in another dtype without a second copy of it: each module's weights are cast as it runs.

The BF16 reference scores a batch with the policy as a BF16 engine would hold it. A cast copy of the whole
model (or a second engine) costs the model's size again, which a large model does not have next to its fp32
master weights and optimizer state. Here every module that owns parameters swaps in cast copies of them
just before its forward and its own parameters back just after, so at most one module's cast weights exist at
a time; the computation is the one the model gives with all its parameters in that dtype (the embedding's
output, and so every activation after it, in that dtype too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def weights_cast_as_they_run(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """Within the block, forwards of ``model`` compute with its floating-point parameters cast to ``dtype``, each
    module's cast when that module runs. The parameters themselves are never modified, and are back in place
    when the block exits (also when a forward raises). Use under ``torch.no_grad()``: the casts are no leaves."""
    if not dtype.is_floating_point:
        raise ValueError(f"weights can only be cast to a floating-point dtype, got {dtype}")
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def cast(module: nn.Module, args: Any) -> None:
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                swapped.append((module, name, p))
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)

    def restore(module: nn.Module, args: Any, output: Any) -> None:
        while swapped and swapped[-1][0] is module:
            _, name, p = swapped.pop()
            module._parameters[name] = p

    owners = [m for m in model.modules() if any(p is not None for p in m._parameters.values())]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(cast), m.register_forward_hook(restore))]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for module, name, p in reversed(swapped):
            module._parameters[name] = p
        swapped.clear()


__all__ = ["weights_cast_as_they_run"]
