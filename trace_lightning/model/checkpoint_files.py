"""The files of a Hugging Face checkpoint folder, read and written without knowing any model: JSON configs of
sane size, safetensors shards behind one key -> tensor reader, and the error that names the file at fault.

Both the dense conversion (``hf``) and the compressed-tensors reader (``hf_compressed``) stand on this module, so
neither needs the other to read a folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted; the message names the file or tensor at fault."""


MAX_JSON_BYTES = 64 * 2**20
"""Larger config / index / tokenizer-config files are refused unread (real ones are kilobytes to megabytes)."""


def read_json_file(file: Path, what: str, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """A JSON object from a regular file of sane size; ``error`` naming the file otherwise (a FIFO, /dev/zero,
    a directory, malformed JSON or a non-object are all refused before or instead of a raw exception)."""
    if not file.is_file():
        raise error(f"missing {what}: {file} is not a regular file")
    if file.stat().st_size > MAX_JSON_BYTES:
        raise error(f"{file}: {file.stat().st_size} bytes is too large for a {what} (limit {MAX_JSON_BYTES})")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise error(f"cannot read {file}: {e}") from e
    if not isinstance(raw, dict):
        raise error(f"{file}: a {what} must be a JSON object, got {type(raw).__name__}")
    return raw


class SafetensorsReader:
    """Key -> tensor over one ``model.safetensors`` or the shards of ``model.safetensors.index.json``."""

    def __init__(self, path: Path) -> None:
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.exists():
            weight_map = _weight_map(index)
            files = {name: path / name for name in sorted(set(weight_map.values()))}
        elif single.is_file():
            files = {single.name: single}
            weight_map = {}
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
        self.handles: dict[str, Any] = {}
        for name, file in files.items():
            if not file.is_file():
                raise CheckpointError(f"missing shard {file} (listed in {index.name})")
            try:
                self.handles[name] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot read {file}: {e}") from e
        if not weight_map:
            weight_map = {key: single.name for key in self.handles[single.name].keys()}
        self.weight_map = weight_map

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def num_elements(self) -> int:
        """Elements of every listed tensor, from the headers alone (nothing is read)."""
        total = 0
        for key, file in self.weight_map.items():
            try:
                total += math.prod(self.handles[file].get_slice(key).get_shape())
            except Exception as e:  # safetensors raises its own error types for a key missing from a shard
                raise CheckpointError(f"cannot read tensor {key!r} from {file}: {e}") from e
        return total

    def get(self, key: str) -> Tensor:
        if key not in self.weight_map:
            raise CheckpointError(f"missing tensor {key!r} in the checkpoint")
        file = self.weight_map[key]
        try:
            return self.handles[file].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {file}: {e}") from e


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor: shard file}; shards must be plain relative names inside the checkpoint folder."""
    weight_map = read_json_file(index, "safetensors index", CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor name -> shard file name")
    for name in set(weight_map.values()):
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise CheckpointError(f"{index}: shard {name!r} lies outside the checkpoint folder")
    return weight_map


def write_safetensors(tensors: dict[str, Tensor], path: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """``model.safetensors``, or shards of at most ``max_shard_bytes`` and their index, as transformers writes."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
