"""Load a quantized checkpoint directory into a runnable model whose quantized linears are ``QuantLinear``.

The layout comes from ``config.json["quantization_config"]["quant_method"]``: ``gptq``, ``awq`` or
``compressed-tensors``; each quantized linear keeps its tensors under their on-disk names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file
from torch import nn

from toolkit.formats import awq, compressed_tensors, gptq
from toolkit.formats.checkpoint import MANIFEST
from toolkit.quant.kv_cache import SCALE_NAMES as KV_SCALE_NAMES
from toolkit.runtime.quant_linear import QuantLinear, backend_problem

LAYOUTS: dict[str, ModuleType] = {layout.NAME: layout for layout in (gptq, awq, compressed_tensors)}
_QUANT_SUFFIXES = {s for layout in LAYOUTS.values() for s in layout.SUFFIXES + getattr(layout, "OPTIONAL_SUFFIXES", ())}


class CheckpointError(ValueError):
    """A directory that is not a loadable quantized checkpoint."""


@dataclass(frozen=True)
class _Scheme:
    """What the loader needs from a ``quantization_config``: the layout module and the weight numerics."""

    layout: ModuleType
    bits: int
    group_size: int
    required: tuple[str, ...]  # suffixes every quantized linear must have


def load_quantized(directory: Path | str, dtype: torch.dtype = torch.float32,
                   backend: str = "auto") -> tuple[nn.Module, object]:
    """(model, tokenizer) from a GPTQ, AWQ or compressed-tensors checkpoint; float tensors are cast to ``dtype``.

    backend: how the ``QuantLinear`` modules multiply, ``auto`` | ``reference`` | ``cpu-int4`` | ``triton``
    (``toolkit.runtime.quant_linear``); an explicit backend that cannot run this checkpoint is refused here.
    KV-cache scales (``…self_attn.k_scale`` / ``.v_scale``) become buffers of the attention modules
    (``toolkit.quant.kv_cache.decode_scales`` reads them back per layer).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json: not a model directory")
    config = AutoConfig.from_pretrained(directory)
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        raise CheckpointError(f"{directory} holds no quantization_config; load it as a float model instead")
    scheme = _scheme(directory, quant if isinstance(quant, dict) else quant.to_dict())
    problem = backend_problem(backend, scheme.bits, scheme.group_size)  # widths are checked per linear below
    if problem:
        raise CheckpointError(f"{directory}: {problem}; load it with backend='reference' or 'auto'")
    del config.quantization_config
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    marker = "." + scheme.layout.SUFFIXES[0]  # qweight / weight_packed: present exactly on quantized linears
    for name in sorted(k.removesuffix(marker) for k in state if k.endswith(marker)):
        setattr(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2],
                _quant_linear(directory, scheme, name, model.get_submodule(name), state, backend))
    for name in [k for k in state if k.rpartition(".")[2] in KV_SCALE_NAMES]:  # KV-cache scales: self_attn buffers
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).register_buffer(attr, torch.empty_like(state[name], device="meta"))
    state = {k: (v.to(dtype) if v.is_floating_point() and not _is_quant_buffer(k) else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer


def load_model_or_checkpoint(spec: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): a compound checkpoint through ``load_quantized``, anything else as a float model."""
    from toolkit.models import load_model, load_tokenizer

    config = Path(spec) / "config.json"
    if config.is_file() and "quantization_config" in config.read_text():
        return load_quantized(spec, dtype)
    return load_model(spec, dtype), load_tokenizer(spec)


def read_manifest(directory: Path | str) -> dict:
    """The ``compound.json`` manifest of a checkpoint (empty if absent)."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _scheme(directory: Path, quant: dict) -> _Scheme:
    """Layout and numerics from a ``quantization_config``, refusing variants whose tensors would decode wrong."""
    method = quant.get("quant_method")
    if method not in LAYOUTS:
        raise CheckpointError(f"{directory}: quant_method {method!r} is not supported; "
                              f"expected one of {', '.join(LAYOUTS)}")
    if method == "gptq":
        if quant.get("checkpoint_format", "gptq") != "gptq":
            raise CheckpointError(f"{directory}: GPTQ checkpoint_format {quant['checkpoint_format']!r} is not "
                                  "supported; only v1 zeros (checkpoint_format 'gptq') are read")
        return _Scheme(gptq, quant["bits"], quant["group_size"], gptq.SUFFIXES)
    if method == "awq":
        if str(quant.get("version", "gemm")).lower() != "gemm":
            raise CheckpointError(f"{directory}: AWQ version {quant['version']!r} is not supported; "
                                  "only the GEMM layout is read")
        bits = quant.get("bits", quant.get("w_bit"))
        group_size = quant.get("group_size", quant.get("q_group_size"))
        return _Scheme(awq, bits, group_size, awq.SUFFIXES)
    groups = list(quant.get("config_groups", {}).values())
    if quant.get("format") != "pack-quantized" or len(groups) != 1:
        raise CheckpointError(f"{directory}: only single-scheme pack-quantized compressed-tensors checkpoints are read "
                              f"(format {quant.get('format')!r}, {len(groups)} config groups)")
    weights = groups[0]["weights"]
    required = compressed_tensors.SUFFIXES + (() if weights.get("symmetric", True) else ("weight_zero_point",))
    return _Scheme(compressed_tensors, weights["num_bits"], weights.get("group_size") or -1, required)


def _quant_linear(directory: Path, scheme: _Scheme, name: str, linear: nn.Module, state: dict,
                  backend: str) -> QuantLinear:
    """A ``QuantLinear`` with empty (meta) buffers shaped like ``name``'s tensors in ``state``, for loading into."""
    suffixes = scheme.layout.SUFFIXES + getattr(scheme.layout, "OPTIONAL_SUFFIXES", ())
    packed = {s: torch.empty_like(state[f"{name}.{s}"], device="meta") for s in suffixes if f"{name}.{s}" in state}
    absent = [s for s in scheme.required if s not in packed]
    if absent:
        raise CheckpointError(f"{directory}: {name} has {scheme.layout.SUFFIXES[0]} but no {', '.join(absent)}")
    bias = None if linear.bias is None else torch.empty(linear.out_features, device="meta")
    try:
        return QuantLinear(scheme.layout, linear.in_features, linear.out_features, scheme.bits, scheme.group_size,
                           packed, bias, backend)
    except ValueError as err:  # an explicit backend this linear's width rules out (per-channel cpu-int4)
        raise CheckpointError(f"{directory}: {name}: {err}") from None


def _is_quant_buffer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _QUANT_SUFFIXES
