"""The GGUF export verb: a compound checkpoint or a float model as one GGUF file that llama.cpp loads unchanged.

A compound checkpoint (GPTQ, AWQ or compressed-tensors layout) keeps its codes: every quantized linear goes
``unpack`` (its layout) → ``QuantizedWeight`` → ``gguf_blocks.pack``, with no re-rounding, so llama.cpp computes
with exactly the weights compound's loader runs (Q4_1's minimum ``−scale·zero`` is the one value rounded, to fp16:
within half an fp16 ulp). What GGUF blocks cannot hold is refused with the reason before anything is written:
a group size other than 32, act-order's permuted ``g_idx``, asymmetric 8 bits, other bit widths, scales that are
not fp16 values. Token embeddings (and an untied output) are written as ``EMBEDDING_TYPE`` (Q8_0, round to nearest
over blocks of 32 with fp16 scales), norms as F32.

A float model (alias, directory, .gguf) is written with every 2-D weight in F16 or F32 (``--outtype``): the input
llama.cpp's own quantizer (``llama-quantize``) takes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from toolkit.architectures import UnsupportedFamily, family
from toolkit.formats import FORMATS, gguf, gguf_blocks
from toolkit.formats.checkpoint import MANIFEST, read_tensors
from toolkit.formats.scheme import FormatError
from toolkit.quant.kv_cache import SCALE_NAMES as KV_SCALE_NAMES
from toolkit.quant.primitives import QuantizedWeight, default_g_idx


def export_gguf(model: str | Path, output: str | Path, outtype: str = "F16", overwrite: bool = False) -> Path:
    """Write ``model`` as the GGUF file ``output``: a compound checkpoint with its own codes, anything else as a
    float ``outtype`` (F16 | F32) export. Returns the path written."""
    source, output = Path(str(model)).expanduser(), Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    if output.suffix != ".gguf":
        raise FormatError(f"--output {output}: a GGUF export is one file; name it *.gguf")
    if (source / MANIFEST).is_file():
        spec = str(json.loads((source / MANIFEST).read_text()).get("model", ""))
        return checkpoint_gguf(source, output, spec, overwrite)
    return float_gguf(str(model), output, outtype, overwrite)


def checkpoint_gguf(directory: Path, output: Path, source_spec: str = "", overwrite: bool = False) -> Path:
    """The GGUF file of the checkpoint in ``directory`` (its config.json, tensors and tokenizer: a manifest is not
    needed, so a checkpoint being written can export itself). ``source_spec``: the model it was quantized from,
    whose GGUF pre-tokenizer is kept when it was a GGUF file."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    check_family(config)
    tensors, types = _checkpoint_tensors(directory, config)
    metadata = gguf.tokenizer_metadata(directory, _source_gguf(source_spec))
    return gguf.write_gguf(output, {**_header(config, directory.name, types), **metadata}, tensors, overwrite)


def float_gguf(spec: str, output: Path, outtype: str = "F16", overwrite: bool = False) -> Path:
    """The float GGUF file of model ``spec`` (alias, directory, .gguf), every 2-D weight in ``outtype``."""
    from toolkit.models import load_model, load_tokenizer

    if outtype not in gguf.FLOAT_TYPES:
        raise FormatError(f"--outtype {outtype!r}: float GGUF exports are {' or '.join(gguf.FLOAT_TYPES)}")
    model = load_model(spec)
    check_family(model.config)
    tensors = _float_tensors(model.state_dict(), model.config, outtype)
    with tempfile.TemporaryDirectory() as directory:
        load_tokenizer(spec).save_pretrained(directory)
        metadata = gguf.tokenizer_metadata(Path(directory), _source_gguf(spec))
    header = _header(model.config, Path(spec).stem, {outtype})
    return gguf.write_gguf(output, {**header, **metadata}, tensors, overwrite)


def file_name(directory: Path, type_name: str) -> Path:
    """Where a checkpoint directory keeps its GGUF file: ``<directory>/<directory name>-<type>.gguf`` (the Hub's
    convention of naming the quant type in the file name)."""
    return directory / f"{directory.name}-{type_name}.gguf"


def _header(config, name: str, types: set[str]) -> dict[str, tuple[str, object]]:
    return {
        "general.name": ("str", name),
        "general.file_type": ("u32", gguf.file_type(types)),
        "general.quantization_version": ("u32", 2),
        **gguf.model_metadata(config),
    }


def check_family(config) -> None:
    """FormatError unless ``config``'s family is one GGUF export writes (``Family.gguf``)."""
    try:
        family(config.model_type, "gguf")
    except UnsupportedFamily as err:
        raise FormatError(f"GGUF export writes llama.cpp's {gguf.ARCH} architecture: {err}") from None


def _source_gguf(spec: str) -> Path | None:
    """The GGUF file a model spec names (an embedded alias or a .gguf path), else None."""
    from toolkit.models import EMBEDDED, embedded_gguf

    if spec in EMBEDDED:
        return embedded_gguf(spec)
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _checkpoint_tensors(source: Path, config) -> tuple[list[tuple[str, str, torch.Tensor]], set[str]]:
    """The GGUF tensors of compound checkpoint ``source`` and the block types of its linears."""
    quant = json.loads((source / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") not in FORMATS:
        raise FormatError(f"{source}: quant_method {quant.get('quant_method')!r} is not a layout compound reads")
    scheme = FORMATS[quant["quant_method"]].read_config(quant)
    gguf_blocks.block_type(scheme.bits, scheme.sym, scheme.group_size, scheme.desc_act)  # refused before any read
    layout = scheme.format
    stored = read_tensors(source)
    marker = "." + layout.SUFFIXES[0]
    linears = sorted(name.removesuffix(marker) for name in stored if name.endswith(marker))
    quantized = set(linears)
    out, types = [], set()
    for module in linears:
        parts = {s: stored[f"{module}.{s}"] for s in layout.SUFFIXES + layout.OPTIONAL_SUFFIXES + ("bias",)
                 if f"{module}.{s}" in stored}
        qweight = layout.unpack(parts, scheme.bits, scheme.group_size, scheme.sym)
        if qweight.bias is not None:
            raise FormatError(f"{module} has a bias, which GGUF's {gguf.ARCH} architecture does not hold")
        try:
            type_name, blocks = gguf_blocks.pack(qweight)
        except FormatError as err:
            raise FormatError(f"{module} cannot be written as GGUF blocks exactly: {err}") from None
        heads = gguf.rope_rows(module, config)
        out.append((gguf.tensor_name(module), type_name, blocks if heads is None else gguf.to_rope_order(blocks, heads)))
        types.add(type_name)
    floats = {name: t for name, t in stored.items() if name.rpartition(".")[0] not in quantized}
    out += _float_tensors(floats, config, None)
    return out, types


def _float_tensors(state: dict[str, torch.Tensor], config, outtype: str | None) -> list[tuple[str, str, torch.Tensor]]:
    """GGUF tensors of the float weights in ``state``: norms F32; 2-D weights in ``outtype``, or (None) embeddings
    and an untied output as ``EMBEDDING_TYPE``. A tied ``lm_head`` is not written (llama.cpp reads token_embd), nor
    are KV-cache scales."""
    out = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in sorted(state.items()):
        module, _, kind = name.rpartition(".")
        if kind in KV_SCALE_NAMES:  # llama.cpp scales its quantized KV cache per block itself
            continue
        if kind != "weight" or (tied and module == "lm_head"):
            if kind == "weight":
                continue
            raise FormatError(f"{name} has no place in GGUF's {gguf.ARCH} architecture")
        if tensor.dim() == 1:
            type_name, data = "F32", tensor
        elif outtype is not None:
            type_name, data = outtype, tensor
        else:
            type_name, data = gguf_blocks.pack(_q8_0(tensor))
        heads = gguf.rope_rows(module, config)
        out.append((gguf.tensor_name(module), type_name, data if heads is None else gguf.to_rope_order(data, heads)))
    return out


def _q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Round-to-nearest symmetric 8-bit codes over blocks of 32 with fp16 scales (Q8_0's grid: d = amax/127)."""
    N, K = weight.shape
    if not gguf.blocks_fit(K):
        raise FormatError(f"a width of {K} is not whole GGUF blocks of {gguf_blocks.BLOCK_SIZE}")
    blocks = weight.float().reshape(N, K // gguf_blocks.BLOCK_SIZE, gguf_blocks.BLOCK_SIZE)
    scale = (blocks.abs().amax(dim=-1) / 127).to(torch.float16).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (torch.round(blocks / scale[..., None]).clamp(-128, 127) + 128).to(torch.uint8).reshape(N, K)
    return QuantizedWeight(codes, scale, torch.full_like(scale, 128, dtype=torch.int32), default_g_idx(K, 32), 8, 32,
                           True)
