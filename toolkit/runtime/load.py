"""Load a quantized checkpoint directory into a runnable model whose quantized linears are ``QuantLinear``.

The layout comes from ``config.json["quantization_config"]["quant_method"]``: ``gptq``, ``awq`` or
``compressed-tensors``; each quantized linear keeps its tensors under their on-disk names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from toolkit.formats import PACKED_SUFFIXES, FormatError, Scheme, read_quantization_config
from toolkit.experts import model_name, moe_layout, unfuse_experts
from toolkit.formats.checkpoint import MANIFEST
from toolkit.models import ModelSource, resolve_model
from toolkit.quant.kv_cache import SCALE_NAMES as KV_SCALE_NAMES
from toolkit.runtime.quant_linear import QuantLinear, backend_problem


class CheckpointError(ValueError):
    """A directory that is not a loadable quantized checkpoint."""


def load_quantized(checkpoint: Path | str | ModelSource, dtype: torch.dtype = torch.float32,
                   backend: str = "auto") -> tuple[nn.Module, object]:
    """(model, tokenizer) from a GPTQ, AWQ or compressed-tensors checkpoint (a directory, or its ``ModelSource``);
    float tensors are cast to ``dtype``.

    backend: how the ``QuantLinear`` modules multiply, ``auto`` | ``reference`` | ``cpu-int4`` | ``triton``
    (``toolkit.runtime.quant_linear``); an explicit backend that cannot run this checkpoint is refused here.
    KV-cache scales (``…self_attn.k_scale`` / ``.v_scale``) become buffers of the attention modules
    (``toolkit.quant.kv_cache.decode_scales`` reads them back per layer). A Mixture-of-Experts model has one
    ``QuantLinear`` per expert projection (``toolkit.experts``), read from the Hub's per-expert tensor names.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if not isinstance(checkpoint, ModelSource):
        if not (Path(checkpoint) / "config.json").is_file():
            raise CheckpointError(f"{checkpoint} has no config.json: not a model directory")
        checkpoint = resolve_model(str(checkpoint))  # config.json and every safetensors header, named when broken
    directory, config = Path(checkpoint.location), checkpoint.fresh_config()
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        raise CheckpointError(f"{directory} holds no quantization_config; load it as a float model instead")
    try:
        scheme = read_quantization_config(quant if isinstance(quant, dict) else quant.to_dict())
    except FormatError as err:
        raise CheckpointError(f"{directory}: {err}") from None
    problem = backend_problem(backend, scheme.bits, scheme.group_size)  # widths are checked per linear below
    if problem:
        raise CheckpointError(f"{directory}: {problem}; load it with backend='reference' or 'auto'")
    del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = unfuse_experts(AutoModelForCausalLM.from_config(config, dtype=dtype))
    layout = moe_layout(model)
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update({model_name(layout, k): t for k, t in load_file(shard).items()})
    marker = "." + scheme.format.SUFFIXES[0]  # qweight / weight_packed: present exactly on quantized linears
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
    return model.eval(), checkpoint.tokenizer()


def load_model_or_checkpoint(source: ModelSource, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a resolved model: a compound checkpoint through ``load_quantized``, anything else as a
    float model."""
    if source.quantized:
        return load_quantized(source, dtype)
    return source.load(dtype), source.tokenizer()


def read_manifest(directory: Path | str) -> dict:
    """The ``compound.json`` manifest of a checkpoint (empty if absent)."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _quant_linear(directory: Path, scheme: Scheme, name: str, linear: nn.Module, state: dict,
                  backend: str) -> QuantLinear:
    """A ``QuantLinear`` with empty (meta) buffers shaped like ``name``'s tensors in ``state``, for loading into."""
    suffixes = scheme.format.SUFFIXES + scheme.format.OPTIONAL_SUFFIXES
    packed = {s: torch.empty_like(state[f"{name}.{s}"], device="meta") for s in suffixes if f"{name}.{s}" in state}
    absent = [s for s in scheme.required if s not in packed]
    if absent:
        raise CheckpointError(f"{directory}: {name} has {scheme.format.SUFFIXES[0]} but no {', '.join(absent)}")
    bias = None if linear.bias is None else torch.empty(linear.out_features, device="meta")
    try:
        return QuantLinear(scheme.format, linear.in_features, linear.out_features, scheme.bits, scheme.group_size,
                           packed, bias, backend)
    except ValueError as err:  # an explicit backend this linear's width rules out (per-channel cpu-int4)
        raise CheckpointError(f"{directory}: {name}: {err}") from None


def _is_quant_buffer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in PACKED_SUFFIXES
