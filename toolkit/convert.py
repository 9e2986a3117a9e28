"""The ``convert`` verb: re-pack a compound checkpoint into another layout without re-quantizing.

Every quantized linear goes ``unpack`` (source layout) → ``QuantizedWeight`` (codes, scale, zero, g_idx) → ``pack``
(target layout), and is unpacked again to check that the target holds the very same numbers; everything else
(embeddings, norms, ``lm_head``, KV-cache scales, tokenizer files) is copied as is. A conversion the target cannot
hold exactly is refused with the reason (docs/formats.md §2–§5):

| target             | refused when                                                                         |
|--------------------|--------------------------------------------------------------------------------------|
| gptq               | asymmetric weights (vLLM loads GPTQ only symmetric; v1 zeros underflow)              |
| awq                | bits ≠ 4, per-channel scales (group_size −1), act-order groups (AWQ has no g_idx)     |
| compressed-tensors | bits not 4 or 8, act-order groups (``actorder: group`` is no longer read), INT8 KV scales |
| any                | a scale the target's scale dtype cannot hold exactly (e.g. bf16 scales into fp16)     |
| gguf (a file)      | group size ≠ 32, act-order groups, asymmetric 8 bits, a family without a llama.cpp         |
|                    | architecture (``Family.gguf``: llama, gemma3_text; ``toolkit.gguf_export``)            |

The manifest keeps the original quantization record and appends the conversion (formats, source path and the
source's file hashes) to ``conversions``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.formats import FORMATS, LAYOUTS, compressed_tensors, gguf
from toolkit.formats.checkpoint import MANIFEST, WEIGHTS_INDEX, read_tensors, write_directory
from toolkit.options import check_choices, option
from toolkit.quant import kv_cache as kv
from toolkit.quant.configs import ConfigError, make_config
from toolkit.quant.primitives import QuantizedWeight
from toolkit.version import __version__

@dataclass(frozen=True)
class ConvertOptions:
    """What a user sets for ``compound convert`` (the flags are derived from these fields)."""

    format: str = option(help="Target layout; gguf: one file for llama.cpp (Q4_0 from symmetric 4-bit, Q4_1 from "
                         "asymmetric 4-bit, Q8_0 from symmetric 8-bit, written from the checkpoint's own codes; group "
                         "size 32 without act-order, else refused with the reason: nothing is re-rounded).",
                         choices=tuple(FORMATS))
    outtype: str = option("F16", "--format gguf of a float model: the type of its weights.", choices=gguf.FLOAT_TYPES)

    def __post_init__(self):
        check_choices(self, ConfigError)


_NOT_COPIED = {WEIGHTS_INDEX, "config.json", "quantize_config.json", MANIFEST}  # rewritten, not copied


class ConversionError(ConfigError):
    """A conversion the target layout cannot represent exactly; the message says why."""


def convert(model: Path | str, fmt: str, output: Path | str, *, overwrite: bool = False,
            outtype: str = ConvertOptions.outtype) -> Path:
    """Re-pack the compound checkpoint ``model`` as ``fmt`` (one of ``FORMATS``) into ``output``. A format that is
    one file (GGUF) is written by ``toolkit.gguf_export`` (a float ``model`` in ``outtype``).

    Steps for a directory layout: 1. read the source's config, manifest and numerics, refuse a target that cannot hold them; 2. read its
    tensors; 3. re-pack every quantized linear, checking the round trip; 4. write the new directory atomically.
    """
    ConvertOptions(fmt, outtype)  # refuses a target or an outtype outside its choices
    if not FORMATS[fmt].CHECKPOINT:
        from toolkit.gguf_export import export_gguf

        return export_gguf(model, output, outtype, overwrite)
    source, output = Path(model), Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    config_json, manifest = _read_json(source, "config.json"), _read_json(source, MANIFEST)  # 1
    quant = config_json.get("quantization_config") or {}
    src_fmt = quant.get("quant_method")
    if src_fmt not in LAYOUTS:
        raise ConfigError(f"{source}: quant_method {src_fmt!r} is not a layout compound writes ({', '.join(LAYOUTS)})")
    if src_fmt == fmt:
        raise ConfigError(f"{source} is already a {fmt} checkpoint; nothing to convert")
    record = dict(manifest["quantization"])
    config = make_config(record.pop("method"), **{k: tuple(v) if k == "skip" else v for k, v in record.items()})
    target, origin = LAYOUTS[fmt], LAYOUTS[src_fmt]
    kv_info = manifest.get("kv_cache")
    _check_target(fmt, config, kv_info)
    dtype = getattr(torch, config_json.get("torch_dtype", "float16"))

    tensors = read_tensors(source)  # 2
    marker = "." + origin.SUFFIXES[0]  # qweight / weight_packed: present exactly on quantized linears
    linears = sorted(name.removesuffix(marker) for name in tensors if name.endswith(marker))
    suffixes = origin.SUFFIXES + origin.OPTIONAL_SUFFIXES + ("bias",)
    quantized = set(linears)
    out = {name: t for name, t in tensors.items() if name.rpartition(".")[0] not in quantized}  # float, KV scales
    for name in linears:  # 3
        parts = {s: tensors[f"{name}.{s}"] for s in suffixes if f"{name}.{s}" in tensors}
        qweight = origin.unpack(parts, config.bits, config.group_size, config.sym)
        packed = _repack(name, qweight, target, dtype)
        out.update({f"{name}.{suffix}": t for suffix, t in packed.items()})

    quantization_config = target.quantization_config(config)
    if kv_info and fmt == compressed_tensors.NAME:
        quantization_config["kv_cache_scheme"] = kv.kv_cache_scheme(kv_info["dtype"], kv_info["strategy"])
    conversion = {"from": src_fmt, "to": fmt, "source": str(source), "compound_version": __version__,
                  "source_files": manifest.get("files", {})}
    new_manifest = {**{k: v for k, v in manifest.items() if k != "files"}, "format": fmt,
                    "compound_version": __version__,
                    "conversions": [*manifest.get("conversions", []), conversion]}

    def copy_extras(staging: Path) -> None:  # tokenizer, generation config, model card
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in _NOT_COPIED and path.suffix not in (".safetensors", ".gguf"):
                shutil.copy2(path, staging / path.name)

    return write_directory(output, out, {**config_json, "quantization_config": quantization_config},  # 4
                           new_manifest, copy_extras, overwrite)


def _read_json(directory: Path, name: str) -> dict:
    path = directory / name
    if not path.is_file():
        what = "a model directory" if name == "config.json" else "a compound checkpoint (convert needs its manifest)"
        raise FileNotFoundError(f"{path} is missing: {directory} is not {what}")
    return json.loads(path.read_text())


def _check_target(fmt: str, config, kv_info: dict | None) -> None:
    """Refuse, before reading any tensor, what the target layout cannot carry, naming the reason."""
    try:
        LAYOUTS[fmt].check_supported(config)
    except ConfigError as err:
        raise ConversionError(f"cannot convert to {fmt}: {err}") from None
    if fmt == compressed_tensors.NAME and kv_info and kv_info["dtype"] != "fp8":
        raise ConversionError(f"cannot convert to {fmt}: its {kv_info['dtype']} KV-cache scales have no "
                              "kv_cache_scheme vLLM accepts (FP8 only)")


def _repack(name: str, qweight: QuantizedWeight, target, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``target.pack(qweight)``, refused unless unpacking it gives back the same codes, zeros, scales, groups and
    bias. ``pack`` itself refuses what the layout has no place for (act-order g_idx in AWQ or compressed-tensors)."""
    try:
        packed = target.pack(qweight, dtype)
    except ValueError as err:
        raise ConversionError(f"cannot convert {name} to {target.NAME}: {err}") from None
    back = target.unpack(packed, qweight.bits, qweight.group_size, qweight.sym)
    for field in ("codes", "zero", "scale", "g_idx", "bias"):
        a, b = getattr(qweight, field), getattr(back, field)
        same = a is None and b is None or (
            a is not None and b is not None and a.shape == b.shape and torch.equal(a.float(), b.float()))
        if not same:
            why = ("are not exactly representable in the target's scale dtype" if field in ("scale", "bias")
                   else "do not survive the layout")
            raise ConversionError(f"cannot convert {name} to {target.NAME} exactly: its {field} values {why}")
    return packed
