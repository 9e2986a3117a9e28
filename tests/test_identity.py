"""``toolkit.identity``: a local model is pinned by its files' sizes, mtimes and safetensors headers (no weight byte
read, so a recipe's dry run of a big model is instant), the full content hash only where a manifest records it; a
Hub id by the revision it resolves to (tests/hub/test_hub_public.py serves one)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from rich.console import Console

from toolkit.identity import target_identity, weights_sha256

GiB = 2**30


def _rewrite_in_place(path: Path) -> None:
    """New bytes at the end of ``path``, same size, and an mtime one second later (whatever the clock's grain)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert path.stat().st_size == before.st_size


def test_rewriting_a_weight_file_changes_the_identity(tmp_path, tiny_llama_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    first = target_identity(str(model))
    assert first == target_identity(str(model)) and first["sha256"]  # stable while nothing changes
    full = weights_sha256(str(model))
    _rewrite_in_place(model / "model.safetensors")
    assert target_identity(str(model))["sha256"] != first["sha256"]
    assert weights_sha256(str(model)) != full  # the manifest's hash reads every byte


def _sparse_model(directory: Path, size: int) -> Path:
    """A model directory whose safetensors file declares one float32 tensor of ``size`` bytes and holds none of
    them on disk (a sparse file): hashing it would read ``size`` bytes of zeros."""
    directory.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    weights = directory / "model.safetensors"
    with open(weights, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    return directory


def _bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux ``/proc/self/io`` rchar)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def test_a_dry_run_reads_no_weight_bytes(tmp_path):
    from toolkit.recipes import load_recipe, run_recipe

    model = _sparse_model(tmp_path / "big-model", 2 * GiB)
    recipe = tmp_path / "big.yaml"
    recipe.write_text(f"model: {model}\noutput: {tmp_path / 'out'}\nquantize: {{method: rtn, group_size: 32}}\n")
    loaded = load_recipe(recipe)
    started = _bytes_read()
    summary = run_recipe(loaded, dry_run=True, console=Console(quiet=True))
    assert _bytes_read() - started < 64 * 2**20  # the header and small files, not the 2 GiB of weights
    assert summary.step("quantize").status == "would run" and not (tmp_path / "out").exists()
    before = summary.step("quantize").fingerprint
    _rewrite_in_place(model / "model.safetensors")
    assert run_recipe(loaded, dry_run=True, console=Console(quiet=True)).step("quantize").fingerprint != before


def test_an_unreachable_uncached_hub_id_is_pinned_by_nothing():
    identity = target_identity("compound-test/never-cached")  # offline (tests/conftest.py): no request is made
    assert identity == {"name": "compound-test/never-cached", "sha256": None, "hashed": "revision", "revision": None}
