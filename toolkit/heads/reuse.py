"""What each reusable piece of a ``train-heads`` work directory was made from, so a rerun reuses only its own work.

The pieces, named relative to the work directory: ``distill.jsonl`` (self-distilled answers), a hidden-state cache
(``hidden``, ``hidden-<layers>``, with its interrupted ``.partial``) and the training state of a head shape
(``train-*``). Each is recorded in ``made-for.json`` ({piece: record}, written atomically) before a run builds or
reuses it. A record is the target's identity (``toolkit.identity.target_identity``: its name and the ``sha256`` that
pins its weights), the dtype it ran in and the answers trained on; two records match when their ``sha256`` (the name,
for a target with none), dtype and answers agree. A piece whose record does not match this run's, or that has none,
is removed and rebuilt, with one line saying why.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from toolkit.formats.checkpoint import write_text_atomic

LEDGER = "made-for.json"


def claim(work: Path, pieces: Sequence[str], record: dict, console: Console) -> None:
    """Remove each of ``pieces`` of ``work`` that was made from something other than ``record``, saying why in one
    line, then record every one of them as made from ``record``."""
    path = work / LEDGER
    ledger = json.loads(path.read_text()) if path.exists() else {}
    stale: dict[str, list[str]] = {}  # why → pieces
    for name in pieces:
        found = [p for p in (work / name, work / f"{name}.partial") if p.exists()]
        if found and not _matches(ledger.get(name), record):
            stale.setdefault(_why(ledger.get(name), record), []).append(name)
            for piece in found:
                if piece.is_dir():
                    shutil.rmtree(piece)
                else:
                    piece.unlink()
        ledger[name] = record
    for why, names in stale.items():
        console.print(f"{work}: rebuilding {', '.join(names)}, made for {why}", soft_wrap=True, markup=False,
                      highlight=False)
    write_text_atomic(path, json.dumps(ledger, indent=1) + "\n")


def _pins(record: dict) -> tuple:
    """What a piece depends on: the weights (by hash, else by name), the dtype they ran in, the answers."""
    return record.get("sha256") or record.get("name"), record.get("dtype"), record.get("answers")


def _shown(record: dict) -> tuple[str, str, str]:
    """``_pins`` of ``record`` as a reader knows them: the target by name and short hash."""
    sha = f" (sha256 {record['sha256'][:12]})" if record.get("sha256") else ""
    return f"{record.get('name')}{sha}", str(record.get("dtype")), f"{record.get('answers')} answers"


def _matches(old: dict | None, new: dict) -> bool:
    return old is not None and _pins(old) == _pins(new)


def _why(old: dict | None, new: dict) -> str:
    """What a piece made from ``old`` was made for, against this run's ``new``: the parts that differ."""
    if old is None:
        return f"an unrecorded target (this run: {' in '.join(_shown(new)[:2])} on {_shown(new)[2]})"
    parts = zip(("target ", "dtype ", ""), _pins(old), _pins(new), _shown(old), _shown(new))
    return "; ".join(f"{label}{was}, not {now}" for label, a, b, was, now in parts if a != b)
