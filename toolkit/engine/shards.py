"""Reading a Hugging Face safetensors checkpoint a few tensors at a time.

A directory holds either one ``model.safetensors`` or shards named by ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``). ``ShardIndex.read`` opens only the shards that hold the names
asked for (``safe_open`` maps the file and copies out just those tensors), so a caller can walk a model far larger
than memory one decoder layer at a time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from toolkit.formats.checkpoint import WEIGHTS, WEIGHTS_INDEX


def is_safetensors_dir(path: Path | str) -> bool:
    """Whether ``path`` is a local model directory whose weights are safetensors (single file or indexed shards)."""
    path = Path(path).expanduser()
    return path.is_dir() and ((path / WEIGHTS_INDEX).is_file() or (path / WEIGHTS).is_file())


class ShardIndex:
    """Where each tensor of a safetensors model directory lives, and a reader for any subset of them."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory).expanduser()
        index = self.directory / WEIGHTS_INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.directory / WEIGHTS).is_file():
            with safe_open(self.directory / WEIGHTS, framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), WEIGHTS)
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {WEIGHTS} nor {WEIGHTS_INDEX}")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (floating ones cast to ``dtype`` when given), reading only the shards that hold them."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self.weight_map:
                raise KeyError(f"tensor {name!r} is in no shard of {self.directory}")
            by_file[self.weight_map[name]].append(name)
        out = {}
        for filename, file_names in by_file.items():
            with safe_open(self.directory / filename, framework="pt") as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    out[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        return out
