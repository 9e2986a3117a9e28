"""The GGUF export verb: a compound checkpoint or a float model as one GGUF file that llama.cpp loads unchanged; and
``quantize --gguf``'s file, written from the weights in hand (``QuantizedGGUF``).

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

from toolkit.architectures import UnsupportedFamily, family
from toolkit.formats import LAYOUTS, gguf, gguf_blocks
from toolkit.formats.checkpoint import MANIFEST, read_tensors
from toolkit.formats.scheme import FormatError
from toolkit.quant.configs import WeightQuantConfig


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
    tensors = _checkpoint_tensors(directory, config)
    metadata = gguf.tokenizer_metadata(directory, _source_gguf(source_spec))
    header = _header(config, directory.name, tensors.types())
    return gguf.write_gguf(output, tensors.family.gguf, {**header, **metadata}, tensors.listed(), overwrite)


def float_gguf(spec: str, output: Path, outtype: str = "F16", overwrite: bool = False) -> Path:
    """The float GGUF file of model ``spec`` (alias, directory, .gguf), every 2-D weight in ``outtype``."""
    from toolkit.models import resolve_model

    if outtype not in gguf.FLOAT_TYPES:
        raise FormatError(f"--outtype {outtype!r}: float GGUF exports are {' or '.join(gguf.FLOAT_TYPES)}")
    source = resolve_model(spec)
    model = source.load()
    check_family(model.config)
    tensors = gguf.FileTensors(model.config)
    tensors.add_floats(model.state_dict(), outtype)
    with tempfile.TemporaryDirectory() as directory:
        source.tokenizer().save_pretrained(directory)
        metadata = gguf.tokenizer_metadata(Path(directory), source.gguf_file)
    header = _header(model.config, Path(spec).stem, {outtype})
    return gguf.write_gguf(output, tensors.family.gguf, {**header, **metadata}, tensors.listed(), overwrite)


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
    """FormatError unless ``config``'s family is one GGUF export writes (``Family.gguf``: its llama.cpp
    architecture) and its architecture carries this config (``gguf.model_metadata``): refused before any weight is
    read."""
    try:
        family(config.model_type, "gguf")
    except UnsupportedFamily as err:
        raise FormatError(f"GGUF export writes the families llama.cpp has an architecture for: {err}") from None
    gguf.model_metadata(config)


def _source_gguf(spec: str) -> Path | None:
    """The GGUF file a model spec names (an embedded alias or a .gguf path), else None."""
    from toolkit.models import EMBEDDED, embedded_gguf

    if spec in EMBEDDED:
        return embedded_gguf(spec)
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _checkpoint_tensors(source: Path, config) -> gguf.FileTensors:
    """The GGUF tensors of compound checkpoint ``source``: each quantized linear unpacked from its layout, its codes
    written unchanged."""
    quant = json.loads((source / "config.json").read_text()).get("quantization_config") or {}
    if quant.get("quant_method") not in LAYOUTS:
        raise FormatError(f"{source}: quant_method {quant.get('quant_method')!r} is not a layout compound reads")
    scheme = LAYOUTS[quant["quant_method"]].read_config(quant)
    gguf_blocks.block_type(scheme.bits, scheme.sym, scheme.group_size, scheme.desc_act)  # refused before any read
    layout = scheme.format
    stored = read_tensors(source)
    marker = "." + layout.SUFFIXES[0]
    quantized = {name.removesuffix(marker) for name in stored if name.endswith(marker)}
    tensors = gguf.FileTensors(config)
    for module in sorted(quantized):
        parts = {s: stored[f"{module}.{s}"] for s in layout.SUFFIXES + layout.OPTIONAL_SUFFIXES + ("bias",)
                 if f"{module}.{s}" in stored}
        tensors.add_linear(module, layout.unpack(parts, scheme.bits, scheme.group_size, scheme.sym))
    tensors.add_floats({name: t for name, t in stored.items() if name.rpartition(".")[0] not in quantized})
    return tensors


class QuantizedGGUF:
    """``quantize --gguf``: the GGUF file of the checkpoint being written, from the weights in hand. ``tensors``
    takes each quantized linear's codes as the engine releases it and the float tensors as the checkpoint stores
    them (in its dtype); ``write(staging)`` writes the file into the checkpoint's directory once its tokenizer is
    there. Built before any weight is read, so a family or grid GGUF cannot hold is refused first."""

    def __init__(self, output: Path, config: WeightQuantConfig, model_config, source_gguf: Path | None):
        check_family(model_config)
        self.path = file_name(Path(output), gguf.block_type(config))
        self.tensors = gguf.FileTensors(model_config)
        self.source_gguf = source_gguf  # the model's own GGUF file, whose pre-tokenizer the file keeps

    def write(self, staging: Path) -> Path:
        """Write the file into ``staging``, the checkpoint directory being assembled (its tokenizer files saved)."""
        metadata = gguf.tokenizer_metadata(staging, self.source_gguf)
        header = _header(self.tensors.config, self.path.parent.name, self.tensors.types())
        return gguf.write_gguf(staging / self.path.name, self.tensors.family.gguf, {**header, **metadata},
                               self.tensors.listed())
