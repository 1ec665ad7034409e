"""Name lookup shared by the RL registries, so every unknown name fails the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(registry: Mapping[str, T], name: str, kind: str) -> T:
    """Return registry[name]; raise ValueError naming the known entries otherwise."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None
