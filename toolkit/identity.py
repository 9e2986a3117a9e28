"""What pins a model's weights, cheaply: how recipe fingerprints and the train-heads work directory tell one target
from another without reading its weights.

| spec | ``target_identity`` pins it by | reads |
|---|---|---|
| a Hub id | the commit its main branch resolves to (``HfApi.model_info``; unreachable: the cached one) | one request |
| a compound checkpoint | the SHA-256 of its manifest, which holds the SHA-256 of every file | one small file |
| a local directory | each file's name, size and mtime, each safetensors header (names, dtypes, shapes, offsets) | KBs |
| a .gguf file, an alias's embedded GGUF | its name, size and mtime | one stat |

Rewriting a weight file gives it a new mtime, so changed weights change the identity although no byte of them is
read. The SHA-256 of every weight byte (``weights_sha256``) is taken only where a manifest records it: the
``target_sha256`` of exported heads.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from toolkit.formats.checkpoint import MANIFEST, sha256_file
from toolkit.models import EMBEDDED, ModelSource, embedded_gguf

HUB_TIMEOUT_S = 10  # one metadata request; a Hub that does not answer by then is treated as unreachable


def target_identity(model: str | ModelSource, api=None) -> dict:
    """``{"name", "sha256", "hashed"}`` of a model spec (or the ``ModelSource`` a verb resolved it to), and
    ``"revision"`` for a Hub id: ``sha256`` changes whenever the weights do (None when nothing pins them: a Hub id
    neither reachable nor cached, a missing path); ``hashed`` says what it covers. ``api``: the ``HfApi`` a Hub id is
    resolved with (default: one for the configured endpoint). A spec is not resolved (no config is read): a recipe's
    fingerprint names a model before any step needs it."""
    spec, path = _local_file(model)
    if path is not None and path.suffix == ".gguf" and path.is_file():
        return _identity(spec, [_stat(path)], path.name)
    if path is not None and (path / MANIFEST).is_file():
        return _identity(spec, [sha256_file(path / MANIFEST)], MANIFEST)
    if path is not None and path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        return _identity(spec, [_stat(f) | _header(f) for f in files], "names, sizes, mtimes, safetensors headers")
    if path is None:
        revision = hub_revision(spec, api)
        return {**_identity(spec, [revision] if revision else [], "revision"), "revision": revision}
    return {"name": spec, "sha256": None, "hashed": None}


def weights_sha256(model: str | ModelSource) -> str | None:
    """The SHA-256 of every weight byte of a local model (the GGUF file; a compound checkpoint's manifest, whose
    hashes cover every file; a directory's safetensors files in name order), None for a Hub id. Reads every byte."""
    _, path = _local_file(model)
    if path is None or not path.exists():
        return None
    if path.suffix == ".gguf":
        return sha256_file(path)
    files = [path / MANIFEST] if (path / MANIFEST).is_file() else sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(sha256_file(f).encode())
    return digest.hexdigest()


def hub_revision(repo_id: str, api=None) -> str | None:
    """The commit ``repo_id``'s main branch points at: asked of the Hub, else (offline, unreachable, refused) the
    one cached locally, else None."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        return (api or HfApi()).model_info(repo_id, timeout=HUB_TIMEOUT_S).sha
    except Exception:  # offline mode, network errors, HTTP refusals alike: what is cached is what would be loaded
        cached = try_to_load_from_cache(repo_id, "config.json")
        return Path(cached).parent.name if isinstance(cached, str) else None


def _local_file(model: str | ModelSource) -> tuple[str, Path | None]:
    """(the spec, the file or directory it names: an alias's embedded GGUF; None for a Hub id, ``org/name`` that is
    not a path). A ``ModelSource`` says both."""
    if isinstance(model, ModelSource):
        return model.spec, model.weights
    if model in EMBEDDED:
        return model, embedded_gguf(model)
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1 or path.suffix == ".gguf":
        return model, path
    return model, None


def _identity(spec: str, parts: list, hashed) -> dict:
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest() if parts else None
    return {"name": spec, "sha256": digest, "hashed": hashed}


def _stat(path: Path) -> dict:
    info = path.stat()
    return {"name": path.name, "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def _header(path: Path) -> dict:
    """The SHA-256 of a safetensors file's header (its first 8 + N bytes: N, then N bytes of JSON); {} otherwise."""
    if path.suffix != ".safetensors":
        return {}
    with open(path, "rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        header = f.read(min(size, 100 * 2**20))  # the format caps headers at 100 MB
    return {"header": hashlib.sha256(raw + header).hexdigest()}
