"""The one place that tells head directories apart: Medusa (vLLM's or FasterDecoding's layout), EAGLE-1, EAGLE-3 and
EAGLE-3 in the speculators layout, each recognised by its registered kind (``toolkit.heads.kinds``) from the
directory's ``config.json`` alone, which engines read too (a directory without compound's manifest, such as another
trainer's, is recognised the same way).

    kind = detect_head(directory)          # the HeadKind, or None for anything else (a quantized checkpoint)
    loaded = load_head(directory)          # LoadedHead(kind, module): the head, every tensor checked
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from toolkit.heads.kinds import KINDS, HeadKind

CONFIG = "config.json"


@dataclass(frozen=True)
class LoadedHead:
    """A head read from disk (float32, not attached to a target) and its kind."""

    kind: HeadKind
    module: nn.Module


def _config(directory: Path) -> dict | None:
    path = directory / CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def detect_head(directory: Path | str) -> HeadKind | None:
    """The kind of the head in ``directory``, or None when its ``config.json`` is missing or no kind's."""
    config = _config(Path(directory))
    return None if config is None else next((kind for kind in KINDS.values() if kind.detects(config)), None)


def load_head(directory: Path | str) -> LoadedHead:
    """The head in ``directory`` with its kind; refuses a directory no kind recognises, naming what each looks for."""
    directory = Path(directory)
    if _config(directory) is None:
        raise FileNotFoundError(f"no {CONFIG} in {directory}: not a head directory written by train-heads")
    kind = detect_head(directory)
    if kind is None:
        looked_for = "; ".join(kind.signature for kind in KINDS.values())
        raise ValueError(f"{directory / CONFIG} is not a draft head compound reads (looked for {looked_for})")
    return LoadedHead(kind, kind.load(directory))
