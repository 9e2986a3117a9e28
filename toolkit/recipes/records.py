"""Step records: ``<output>/.steps/<step>.json`` keeps a step's fingerprint with its results, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.formats.checkpoint import write_text_atomic
from toolkit.recipes.schema import Recipe
from toolkit.version import __version__


def record_path(recipe: Recipe, step: str) -> Path:
    """Where the record of ``step`` lives."""
    return recipe.output / ".steps" / f"{step}.json"


def cached(recipe: Recipe, step: str, fingerprint: str, outputs=()) -> dict | None:
    """The stored record of ``step`` if it has ``fingerprint`` and its outputs exist, else None (an unreadable record
    counts as none: the step runs again)."""
    path = record_path(recipe, step)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if record.get("fingerprint") != fingerprint or not all(Path(p).exists() for p in outputs):
        return None
    return record


def store(recipe: Recipe, step: str, fingerprint: str, inputs: dict, results: dict, seconds: float) -> None:
    """Record that ``step`` ran with ``fingerprint``, with its inputs, results and wall time."""
    record = {"step": step, "fingerprint": fingerprint, "compound_version": __version__, "inputs": inputs,
              "seconds": seconds, "results": results}
    write_text_atomic(record_path(recipe, step), json.dumps(record, indent=1, default=str) + "\n")
