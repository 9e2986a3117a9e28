"""Load a compound checkpoint directory into a runnable model whose quantized linears are ``QuantLinear``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from toolkit.formats.checkpoint import MANIFEST
from toolkit.runtime.quant_linear import QuantLinear


class CheckpointError(ValueError):
    """A directory that is not a loadable compound checkpoint."""


def load_quantized(directory: Path | str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    """(model, tokenizer) from a GPTQ-layout compound checkpoint; float tensors are cast to ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json: not a model directory")
    config = AutoConfig.from_pretrained(directory)
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        raise CheckpointError(f"{directory} holds no quantization_config; load it as a float model instead")
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "gptq":
        raise CheckpointError(f"{directory}: quant_method {quant.get('quant_method')!r} is not supported yet")
    del config.quantization_config
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantized_modules = {name.removesuffix(".qweight") for name in state if name.endswith(".qweight")}
    for name in quantized_modules:
        old = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        new = QuantLinear(old.in_features, old.out_features, quant["bits"], quant["group_size"], old.bias is not None)
        setattr(model.get_submodule(parent_name), child, new)
    state = {k: (v.to(dtype) if v.is_floating_point() and not _is_quant_buffer(k) else v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer


def read_manifest(directory: Path | str) -> dict:
    """The ``compound.json`` manifest of a checkpoint (empty if absent)."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _is_quant_buffer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")
