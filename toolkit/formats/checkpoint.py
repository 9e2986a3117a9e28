"""Writing a quantized model directory atomically, with its config and a manifest of hashes.

The directory is assembled in a temporary sibling (``.<name>.tmp-<pid>-<hex>``), its files and itself fsynced and
given the permissions the umask allows (as any file a user writes: a serving container running as another user
reads them), and renamed into place only when complete, so a crash or Ctrl-C never leaves a half checkpoint where a
loader would find it. An existing output being replaced is moved aside (``.<name>.old-…``) and put back if the
rename fails. Scratch space of a run (``.<name>.activations-…``) is named the same way, so that a later run for the
same output finds what a killed one left (``remove_leftovers``), and only that: the pid in the name tells a dead
run's directory from a live one's on this host.

Tensors above ``max_shard_size`` are split the Hugging Face way (``huggingface_hub.split_torch_state_dict_into_shards``,
what ``save_pretrained`` uses): ``model-00001-of-0000n.safetensors`` … plus ``model.safetensors.index.json`` =
``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}``; a single ``model.safetensors``
otherwise. vLLM, SGLang and transformers read either; the manifest hashes every file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from toolkit.experts import hub_tensors
from toolkit.quant.finite import NonFiniteError, all_finite

MANIFEST = "compound.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = "2GB"  # largest safetensors file written (huggingface_hub size string, or an int in bytes)
SIBLINGS = ("tmp", "old", "activations")  # the kinds of hidden sibling a run makes next to its output
WRITING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # errors only writing can raise
MiB = 2**20


class OutputError(OSError):
    """An output that cannot be written (a parent that is a file, no permission, no space), said in one line."""


@contextmanager
def atomic_directory(output: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``output`` when the block exits cleanly, and vanishes otherwise.
    Leftovers of killed runs for the same ``output`` are removed first, with a warning naming them.

    An ``OSError`` of writing (a full disk, a read-only file system, or any error on a file inside the directory)
    is raised as an ``OutputError`` naming ``output``."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    removed = remove_leftovers(output)  # what killed runs for this output left (quantize says so itself, earlier)
    if removed:
        warnings.warn(f"removed {len(removed)} leftover(s) of killed runs for {output.name} in {output.parent}: "
                      f"{', '.join(removed)}", stacklevel=3)
    staging = _make_sibling(output, "tmp")
    with _removed_on_failure(staging, output):
        yield staging
        _settle(staging)
        _swap_in(staging, output)


@contextmanager
def scratch_directory(output: Path) -> Iterator[Path]:
    """Yield an empty hidden directory beside ``output`` (``.<name>.activations-…``) for a run's scratch files,
    removed when the block exits; errors of writing it are raised as for ``atomic_directory``."""
    directory = _make_sibling(Path(output), "activations")
    with _removed_on_failure(directory, output):
        yield directory
    shutil.rmtree(directory)


@contextmanager
def _removed_on_failure(directory: Path, output: Path) -> Iterator[None]:
    """Remove ``directory`` when the block raises; an ``OSError`` of writing there is raised as an ``OutputError``."""
    try:
        yield
    except BaseException as err:
        shutil.rmtree(directory, ignore_errors=True)
        if isinstance(err, OSError) and not isinstance(err, OutputError) and _is_writing(err, directory, output):
            raise OutputError(f"could not write --output {output}: {err.strerror or err} "
                              f"({err.filename or output.parent}); nothing was left behind: free some space there "
                              f"or choose another --output") from err
        raise


def remove_leftovers(output: Path) -> list[str]:
    """Remove what runs for ``output`` that were killed left beside it (``.<name>.tmp-…``, ``.old-…``,
    ``.activations-…`` of a process no longer running) and return their names; other files are never touched."""
    output = Path(output)
    pattern = re.compile(rf"\.{re.escape(output.name)}\.(?:{'|'.join(SIBLINGS)})-(\d+)-[0-9a-f]{{8}}")
    if not output.parent.is_dir():
        return []
    removed = []
    for path in sorted(output.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and not _running(int(match[1])):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(path.name)
    return removed


def check_output(output: Path, needed: int) -> None:
    """Refuse, before any work, an ``output`` that cannot be written: one whose parent is a file, a directory in
    which no file can be created, or less free space there than ``needed`` bytes."""
    output = Path(output)
    base = output.parent
    while not base.exists() and base != base.parent:
        base = base.parent  # the nearest existing ancestor: atomic_directory makes the rest
    if not base.is_dir():
        raise OutputError(f"--output {output}: {base} is a file, not a directory; choose another --output")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as err:
        raise OutputError(f"--output {output}: cannot create files in {base} ({err.strerror or err}); "
                          f"choose another --output") from err
    free = shutil.disk_usage(base).free
    if free < needed:
        raise OutputError(f"--output {output}: this run writes about {needed / MiB:.0f} MiB but {base} has "
                          f"{free / MiB:.0f} MiB free; free some space or choose another --output")


def _make_sibling(output: Path, kind: str) -> Path:
    """A new directory ``.<name>.<kind>-<pid>-<hex>`` beside ``output`` (its parents made), with the umask's
    permissions."""
    output.parent.mkdir(parents=True, exist_ok=True)
    path = sibling(output, kind)
    path.mkdir()
    return path


def sibling(output: Path, kind: str) -> Path:
    """A new hidden sibling path of ``output`` for this process (``.<name>.<kind>-<pid>-<hex>``), which
    ``remove_leftovers`` removes once this process is gone."""
    return output.parent / f".{output.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _is_writing(err: OSError, directory: Path, output: Path) -> bool:
    """Whether ``err`` comes from writing (a full disk, or a file in ``directory`` or ``output`` itself), not from
    reading an input."""
    names = [Path(os.fsdecode(name)) for name in (err.filename, err.filename2) if isinstance(name, (str, bytes))]
    return err.errno in WRITING_ERRNOS or any(name == output or name.is_relative_to(directory) for name in names)


def _settle(staging: Path) -> None:
    """Give every file and directory under ``staging`` the umask's permissions (safetensors writes 0600) and fsync
    them, files before the directories that list them, so the rename publishes data that is on disk."""
    umask = os.umask(0)
    os.umask(umask)
    for path in sorted(staging.rglob("*"), key=lambda p: -len(p.parts)):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        _fsync(path)
    os.chmod(staging, 0o777 & ~umask)
    _fsync(staging)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_in(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``; an existing ``output`` is moved aside first, and put back if that fails."""
    if not output.exists():
        os.replace(staging, output)
        _fsync(output.parent)
        return
    trash = sibling(output, "old")
    os.replace(output, trash)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(trash, output)
        raise
    _fsync(output.parent)
    shutil.rmtree(trash)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, so that a reader sees the old or the new file,
    never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def float_state_dict(model: nn.Module, exclude: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors not replaced by quantized ones, cast to ``dtype``; a tied ``lm_head`` is not repeated."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {name: t for name, t in model.state_dict().items() if not (tied and name == "lm_head.weight")}
    return float_tensors(state, exclude, dtype)


def float_tensors(state: dict[str, torch.Tensor], exclude: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` (full names) less the tensors of the modules ``exclude``, floating ones cast to ``dtype``."""
    out = {}
    for name, tensor in state.items():
        if name.rsplit(".", 1)[0] in exclude:
            continue
        out[name] = tensor.detach().to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()
    return out


def packed_tensors(quantized: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{module: {suffix: tensor}}`` in a format's layout → ``{module.suffix: tensor}``."""
    return {f"{module}.{suffix}": t.contiguous() for module, parts in quantized.items() for suffix, t in parts.items()}


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
    *,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    then: Callable[[Path], None] | None = None,
) -> Path:
    """Write model + quantized tensors + tokenizer + configs + manifest to ``output`` atomically.

    quantized: ``{module name: {suffix: tensor}}`` in the target layout; those modules' float weights are left out.
    Tensors are written under the names the family's Hub checkpoints use (``toolkit.experts.hub_tensors``).
    extra_tensors: further tensors by full name, written as given (e.g. the KV-cache scales ``…self_attn.k_scale``).
    then: writes more files into the staging directory once tensors, configs and tokenizer are there (a GGUF copy),
    before the manifest hashes every file.
    """
    tensors = float_state_dict(model, set(quantized), dtype)
    tensors.update(packed_tensors(quantized))
    tensors.update({name: t.contiguous() for name, t in (extra_tensors or {}).items()})
    tensors = hub_tensors(model, tensors)
    config = export_config(model, dtype, quantization_config)
    return write_directory(output, tensors, config, manifest, model_extras(model, tokenizer, then), overwrite,
                           max_shard_size)


def model_extras(model: nn.Module, tokenizer, then: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """``save_extras`` for a model's directory: its generation config (when it has one) and its tokenizer, then
    whatever ``then(staging)`` writes."""

    def save_extras(staging: Path) -> None:
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if then is not None:
            then(staging)

    return save_extras


def write_directory(
    output: Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    manifest: dict,
    save_extras: Callable[[Path], None] | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write ``tensors`` (sharded above ``max_shard_size``), ``config.json`` (its ``quantization_config`` also as
    ``quantize_config.json``), whatever ``save_extras(staging_dir)`` adds (tokenizer files), and the manifest with
    the SHA-256 of every file, atomically."""
    with atomic_directory(Path(output), overwrite) as staging:
        save_tensors(staging, tensors, max_shard_size)
        write_metadata(staging, config, manifest, save_extras)
    return Path(output)


def write_metadata(
    staging: Path, config: dict, manifest: dict, save_extras: Callable[[Path], None] | None = None
) -> None:
    """Into a directory whose tensors are written: ``config.json`` (its ``quantization_config`` also as
    ``quantize_config.json``), whatever ``save_extras(staging)`` adds, then the manifest with every file's SHA-256."""
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if config.get("quantization_config") is not None:
        (staging / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n")
    if save_extras is not None:
        save_extras(staging)
    files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
    (staging / MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2) + "\n")


class ShardWriter:
    """Writes a checkpoint's tensors one shard at a time as they become ready (``model-0000i-of-0000n.safetensors``,
    ``shards`` in all, known up front), then ``model.safetensors.index.json``: how a streamed run writes each
    quantized layer and frees it."""

    def __init__(self, directory: Path, shards: int):
        self.directory, self.shards = Path(directory), shards
        self.weight_map: dict[str, str] = {}
        self.written = self.total_size = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.written == self.shards:
            raise RuntimeError(f"all {self.shards} shards are written already")
        self.written += 1
        filename = f"model-{self.written:05d}-of-{self.shards:05d}.safetensors"
        _save_file(tensors, self.directory / filename)
        self.weight_map.update(dict.fromkeys(tensors, filename))
        self.total_size += sum(t.numel() * t.element_size() for t in tensors.values())

    def write_index(self) -> None:
        if self.written != self.shards:
            raise RuntimeError(f"{self.written} of {self.shards} shards written; the index would name missing files")
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def save_tensors(
    directory: Path, tensors: dict[str, torch.Tensor], max_shard_size: int | str = MAX_SHARD_SIZE
) -> list[str]:
    """Write ``tensors`` as one ``model.safetensors``, or as HF-named shards plus their index when they exceed
    ``max_shard_size`` (a tensor larger than that gets a shard of its own). Returns the files written."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        _save_file({name: tensors[name] for name in names}, Path(directory) / filename)
    if not split.is_sharded:
        return [WEIGHTS]
    index = {"metadata": {"total_size": split.metadata["total_size"]},
             "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    (Path(directory) / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*split.filename_to_tensors, WEIGHTS_INDEX]


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file`` of finite ``tensors`` (refused: ``NonFiniteError``, naming the first bad one); its I/O failures,
    which safetensors reports as ``SafetensorError`` text, raised as the ``OSError`` they are."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not all_finite(tensor):
            hint = " (float16 ends at ±65504: try --dtype bfloat16)" if tensor.dtype == torch.float16 else ""
            raise NonFiniteError(f"non-finite tensor: {name} holds NaN or infinite values as "
                                 f"{str(tensor.dtype).removeprefix('torch.')}{hint}; nothing was written")
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from err


def tensor_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: its single file, or every shard its index names."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS]
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory / missing[0]} is missing: the checkpoint is incomplete")
    return [directory / name for name in names]


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, from its single file or all the shards its index names."""
    from safetensors.torch import load_file

    tensors = {}
    for path in tensor_files(directory):
        tensors.update(load_file(path))
    return tensors


def verify_manifest(directory: Path) -> list[str]:
    """Names of files whose SHA-256 no longer matches the manifest (missing files included)."""
    directory = Path(directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    return [
        name
        for name, digest in manifest.get("files", {}).items()
        if not (directory / name).is_file() or sha256_file(directory / name) != digest
    ]
