"""Quantizing a model larger than memory: decoder layers loaded from safetensors shards one at a time.

``stream_model`` builds the model with every weight on the meta device and materializes only what runs before the
decoder layers (embeddings; RoPE buffers are real from the start). ``StreamedLayers`` is the engine's layer source
(``toolkit.engine.loop.LayerSource``): it reads one layer's tensors from the shards when the engine reaches it, and when
the engine is done with the layer hands it to a ``save`` callback (which writes its quantized form) and returns its
weights to the meta device. The embeddings go back to the meta device too once the first layer's inputs are
captured, and ``outer_tensors`` reads them again, one at a time, when they are written. Peak memory is then about
one float layer plus the calibration activations, whatever the depth (``toolkit.engine.heap.bound_heap`` keeps freed
layer-sized blocks from lingering in the heap). Tensors are read as float32, as ``load_model`` loads them, so a
streamed run computes exactly what an in-memory run does.

GGUF models cannot stream (transformers dequantizes a GGUF file whole); only safetensors directories can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from toolkit.engine.heap import bound_heap, trim_heap
from toolkit.engine.shards import ShardIndex, is_safetensors_dir
from toolkit.experts import hub_name
from toolkit.models import ModelError, ModelSource, arch_spec, decoder_layers

DTYPE = torch.float32  # what load_model computes in; a streamed run must match it bit for bit


def stream_model(source: ModelSource, dtype: torch.dtype = DTYPE) -> tuple[nn.Module, ShardIndex]:
    """(the model of a local safetensors directory with only its pre-layer tensors and final norm in memory, in
    ``dtype``; its shard index).

    Refuses a model that is not such a directory, and a checkpoint whose tensor names do not match the model's
    (renamed or converted checkpoints need ``from_pretrained``'s conversions: the in-memory mode).
    """
    spec = source.spec
    if not is_safetensors_dir(spec):
        raise ModelError(f"--stream reads layers from a local safetensors model directory; {spec!r} is not one "
                         "(a GGUF file or Hub id loads whole: run without --stream)")
    bound_heap()
    model = source.empty(dtype)
    shards = ShardIndex(spec)
    missing = [name for name in expected_tensors(model) if name not in shards]
    if missing:
        raise ModelError(f"{spec}: tensors {missing[:3]} ({len(missing)} in all) are in no shard, so the model "
                         "cannot stream layer by layer; run without --stream")
    prefix = arch_spec(model).layers + "."
    outer = [name for name in expected_tensors(model) if not name.startswith(prefix) and name != "lm_head.weight"]
    model.load_state_dict(shards.read(outer, dtype), strict=False, assign=True)
    return model, shards


def read_layer(model: nn.Module, shards: ShardIndex, index: int, dtype: torch.dtype = DTYPE) -> nn.Module:
    """Decoder layer ``index`` of ``model`` with its weights read from ``shards`` in ``dtype``; ``release_layer``
    returns them to the meta device."""
    layer = decoder_layers(model)[index]
    prefix = f"{arch_spec(model).layers}.{index}."
    layout = arch_spec(model).experts
    on_disk = {hub_name(layout, prefix + name): name for name in layer.state_dict()}
    tensors = shards.read(list(on_disk), dtype)
    layer.load_state_dict({on_disk[full]: t for full, t in tensors.items()}, assign=True)
    return layer


def release_layer(layer: nn.Module) -> None:
    """Put a layer's weights back on the meta device and hand the freed memory back to the OS."""
    layer.to("meta")
    trim_heap()


def expected_tensors(model: nn.Module) -> list[str]:
    """Names of the tensors a checkpoint of ``model`` stores, as the Hub names them (``toolkit.experts.hub_name``;
    a tied ``lm_head.weight`` is not stored)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    layout = arch_spec(model).experts
    return [hub_name(layout, name) for name in model.state_dict() if not (tied and name == "lm_head.weight")]


def outer_names(model: nn.Module) -> list[str]:
    """Names of the model's stored tensors outside its decoder layers (embeddings, final norm, LM head)."""
    prefix = arch_spec(model).layers + "."
    return [name for name in expected_tensors(model) if not name.startswith(prefix)]


def outer_tensors(model: nn.Module, shards: ShardIndex) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each of ``outer_names``, one at a time: from memory, or from the shards where the model's
    tensor is on the meta device."""
    state = model.state_dict()
    for name in outer_names(model):
        yield name, state[name] if not state[name].is_meta else shards.read([name], DTYPE)[name]


class StreamedLayers:
    """The engine's layer source for a streamed model: ``load`` fills decoder layer ``index`` from the shards (and,
    at the first layer, when the engine has captured its inputs, frees the embeddings); ``release`` calls
    ``save(index, layer)`` and puts the layer's weights back on the meta device."""

    def __init__(self, model: nn.Module, shards: ShardIndex, save: Callable[[int, nn.Module], None]):
        self.model = model
        self.prefix = arch_spec(model).layers
        self.shards = shards
        self.save = save

    def load(self, index: int, layer: nn.Module) -> None:
        if index == 0:
            prefix = self.prefix + "."
            for name, param in list(self.model.named_parameters()):
                if not name.startswith(prefix) and not param.is_meta:
                    module, _, attr = name.rpartition(".")
                    setattr(self.model.get_submodule(module), attr, nn.Parameter(param.to("meta"), False))
        read_layer(self.model, self.shards, index)

    def release(self, index: int, layer: nn.Module) -> None:
        self.save(index, layer)
        release_layer(layer)
