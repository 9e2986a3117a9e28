"""Calibration activations kept on disk instead of in memory (``--offload-activations``).

Between two decoder layers the engine holds what enters the next layer for every calibration batch: samples ×
seq_len × hidden float32 values, twice while a layer turns its inputs into outputs (4 GiB each for 128 × 512 tokens
of an 8192-wide model). ``DiskActivations`` stands in for that list: ``append`` writes one batch to its own file and
indexing reads it back, so memory holds one batch at a time. The page cache keeps recently used files warm. Each file
is serialized in memory and written by Python, so that a full disk raises ``OSError`` (ENOSPC, the file named)
rather than torch's ``RuntimeError`` from its zip writer.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch


class DiskActivations(Sequence):
    """A list of tensors, one ``.pt`` file each under ``directory`` (created), read back when indexed."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=False)
        self.paths: list[Path] = []
        self.device = torch.device("cpu")

    def append(self, tensor: torch.Tensor) -> None:
        path = self.directory / f"{len(self.paths):06d}.pt"
        buffer = io.BytesIO()
        torch.save(tensor.detach().cpu().contiguous(), buffer)
        path.write_bytes(buffer.getbuffer())
        self.paths.append(path)
        self.device = tensor.device

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return torch.load(self.paths[index], map_location=self.device, weights_only=True)

    def delete(self) -> None:
        """Remove the files (the list is empty afterwards)."""
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.paths = []
        self.directory.rmdir()
