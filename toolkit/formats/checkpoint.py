"""Writing a quantized model directory atomically, with its config and a manifest of hashes.

The directory is assembled in a temporary sibling (``.<name>.tmp-*``) and renamed into place only when complete,
so a crash or Ctrl-C never leaves a half checkpoint where a loader would find it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

MANIFEST = "compound.json"
WEIGHTS = "model.safetensors"


@contextmanager
def atomic_directory(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``output`` when the block exits cleanly, and vanishes otherwise."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        yield staging
        if output.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, trash / output.name)
            os.replace(staging, output)
            shutil.rmtree(trash)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def float_state_dict(model: nn.Module, exclude: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors not replaced by quantized ones, cast to ``dtype``; a tied ``lm_head`` is not repeated."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = {}
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in exclude or (tied and name == "lm_head.weight"):
            continue
        out[name] = tensor.detach().to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    return out


def export_config(model: nn.Module, dtype: torch.dtype, quantization_config: dict | None) -> dict:
    """``config.json`` content: the original architecture, the saved dtype, and the quantization block."""
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    if not config.get("architectures"):  # GGUF-loaded configs carry none; engines resolve the model class from it
        config["architectures"] = [type(model).__name__]
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = dtype_name
    config["dtype"] = dtype_name
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_checkpoint(
    output: Path,
    model: nn.Module,
    tokenizer,
    quantized: dict[str, dict[str, torch.Tensor]],
    quantization_config: dict | None,
    manifest: dict,
    dtype: torch.dtype = torch.float16,
    overwrite: bool = False,
) -> Path:
    """Write model + quantized tensors + tokenizer + configs + manifest to ``output`` atomically.

    quantized: ``{module name: {suffix: tensor}}`` in the target layout; those modules' float weights are left out.
    """
    tensors = float_state_dict(model, set(quantized), dtype)
    for module, parts in quantized.items():
        tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
    with atomic_directory(Path(output), overwrite) as staging:
        save_file(tensors, staging / WEIGHTS, metadata={"format": "pt"})
        config = export_config(model, dtype, quantization_config)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if quantization_config is not None:
            (staging / "quantize_config.json").write_text(json.dumps(quantization_config, indent=2) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2) + "\n")
    return Path(output)


def verify_manifest(directory: Path) -> list[str]:
    """Names of files whose SHA-256 no longer matches the manifest (missing files included)."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    return [
        name
        for name, digest in manifest.get("files", {}).items()
        if not (directory / name).is_file() or sha256_file(directory / name) != digest
    ]
