"""Per-layer checkpoints of a quantize run, so that a run killed part way resumes after its last finished layer.

As each decoder layer is done, the engine saves what it produced (``LayerCheckpoints.save``): every linear's
``QuantizedWeight``, the layer's other parameters as they then are (a method may have changed them: AWQ folds its
scales into the norms), the errors its driver measured and the calibration tokens routed to each expert. A rerun with
the same ``key`` (the caller's fingerprint of everything the results depend on: model, config, calibration tokens,
batch size) loads those layers instead of quantizing them again; the engine still runs each loaded layer forward,
which is what the next layer's inputs need. A different key empties the directory first.

Each file is written to a temporary name and renamed, so a kill mid-write leaves no half layer behind.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from toolkit.quant.primitives import QuantizedWeight

KEY = "key"


@dataclass
class SavedLayer:
    """One finished layer as ``LayerCheckpoints.load`` returns it."""

    weights: dict[str, QuantizedWeight]
    parameters: dict[str, torch.Tensor]  # the layer's parameters other than the quantized linears' weights
    errors: dict[str, float]
    routed: dict[str, int]

    def restore(self, layer: nn.Module) -> None:
        """Put the saved parameters into ``layer`` (the quantized weights are the engine's to write back)."""
        with torch.no_grad():
            for name, tensor in self.parameters.items():
                layer.get_parameter(name).copy_(tensor)


class LayerCheckpoints:
    """The finished layers of the run fingerprinted by ``key``, one file each in ``directory``."""

    def __init__(self, directory: Path, key: str):
        self.directory = Path(directory)
        stamp = self.directory / KEY
        if self.directory.exists() and not (stamp.is_file() and stamp.read_text() == key):
            shutil.rmtree(self.directory)  # another run's layers
        self.directory.mkdir(parents=True, exist_ok=True)
        stamp.write_text(key)

    def _path(self, index: int) -> Path:
        return self.directory / f"layer-{index}.pt"

    def done(self) -> list[int]:
        """The indices of the layers saved, in order."""
        return sorted(int(p.stem.removeprefix("layer-")) for p in self.directory.glob("layer-*.pt"))

    def save(self, index: int, layer: nn.Module, weights: dict[str, QuantizedWeight], errors: dict[str, float],
             routed: dict[str, int]) -> None:
        """Save layer ``index``: its quantized linears ``weights`` (by name within the layer), its other parameters,
        its driver's ``errors`` and its experts' ``routed`` token counts."""
        quantized = {f"{name}.weight" for name in weights}
        record = {
            "weights": {name: {f.name: _plain(getattr(q, f.name)) for f in fields(q)} for name, q in weights.items()},
            "parameters": {n: p.detach().cpu() for n, p in layer.named_parameters() if n not in quantized},
            "errors": dict(errors),
            "routed": dict(routed),
        }
        path = self._path(index)
        partial = path.with_name(path.name + ".partial")
        torch.save(record, partial)
        os.replace(partial, path)

    def load(self, index: int) -> SavedLayer | None:
        """Layer ``index`` as saved, or None when it was not."""
        path = self._path(index)
        if not path.is_file():
            return None
        record = torch.load(path, weights_only=True)
        weights = {name: QuantizedWeight(**values) for name, values in record["weights"].items()}
        return SavedLayer(weights, record["parameters"], record["errors"], record["routed"])

    def remove(self) -> None:
        """Delete the directory: the run it served is complete."""
        shutil.rmtree(self.directory, ignore_errors=True)


def _plain(value):
    """A tensor as a detached CPU tensor (a bias may be the linear's own Parameter, on the compute device); any other
    value as it is."""
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
