"""What of an artifact goes public: the files compound writes names into, and the card's results, with every local
path cut to its last component (``/home/me/models/llama`` → ``llama``; the manifest then hashes the bytes uploaded).
The files on disk are not changed."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from toolkit.formats.checkpoint import MANIFEST

# Files of an artifact in which compound writes names (the model, dataset, target, conversion source; a
# FasterDecoding-layout Medusa config names its target): push uploads them with local paths cut. The other files come
# from transformers (tokenizer, generation config), which writes no path into them.
NAMING_FILES = (MANIFEST, "config.json")
# A word of free text that may be a path: what lies between spaces, quotes and brackets.
_WORD = re.compile(r"[^\s'\"`|,;()\[\]{}<>=]+")


def published(directory: Path | str) -> tuple[dict, dict[str, bytes]]:
    """(the manifest as pushed, {file name: bytes uploaded instead of the file on disk}): each of ``NAMING_FILES``
    that names a local path, rewritten with the path cut to its last component, the manifest hashing the rewritten
    bytes. The files on disk are left as they are."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    files = manifest.get("files", {})
    rewritten = {}
    for name in NAMING_FILES[1:]:
        raw = json.loads((directory / name).read_text()) if name in files else None
        if (scrubbed := public(raw)) != raw:
            rewritten[name] = (json.dumps(scrubbed, indent=2) + "\n").encode()
    hashes = {name: hashlib.sha256(data).hexdigest() for name, data in rewritten.items()}
    pushed = {**public(manifest), "files": {**files, **hashes}}
    if pushed != manifest:
        rewritten[MANIFEST] = (json.dumps(pushed, indent=2) + "\n").encode()
    return pushed, rewritten


def public(value):
    """``value`` (parsed JSON) with every local path in it, whole or inside text, cut to its last component."""
    if isinstance(value, dict):
        return {key: public(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [public(item) for item in value]
    if isinstance(value, str):
        return display(value) if _is_local_path(value) else _WORD.sub(lambda word: display(word.group()), value)
    return value


def _is_local_path(text: str) -> bool:
    """Whether ``text`` names a place on this machine (absolute, home- or dot-relative, or an existing relative
    path) by more than its last component."""
    path = Path(text)
    anchored = text.startswith(("/", "~/", "./", "../")) or ("/" in text and path.exists())
    return anchored and path.name not in ("", text)


def display(spec) -> str:
    """A model spec as the card shows it: local paths by their last component only (no directory layout leaks)."""
    text = str(spec)
    return Path(text).name if _is_local_path(text) else text
