"""A target too large for memory, run for its hidden states one decoder layer at a time (``--stream-target``).

The heads' hidden-state cache needs only a forward of the target per batch, never generation, so the target can be
streamed like the quantize engine streams it: the embeddings and final norm stay in memory, and each forward reads
every decoder layer from the safetensors shards in turn (``toolkit.engine.streaming.read_layer``), runs the whole batch
through it and returns its weights to the meta device. Peak memory: embeddings + one layer + the batch's
activations. The model's own forward computes what enters the first layer (position embeddings, masks), and every
layer gets the same keyword arguments the full model would pass it, so the states are those of the in-memory model
in the same dtype, bit for bit. Each forward reads the whole model from disk: give it large batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from toolkit.engine.session import capture_layer_inputs
from toolkit.engine.streaming import read_layer, release_layer, stream_model
from toolkit.models import ModelError, ModelSource, arch_spec, decoder_layers


class StreamedTarget:
    """The float causal LM of a local safetensors directory, with only its embeddings and final norm in memory."""

    def __init__(self, source: ModelSource, dtype: torch.dtype = torch.bfloat16):
        self.model, self.shards = stream_model(source, dtype)
        self.dtype = dtype
        backbone = self.model.get_submodule(arch_spec(self.model).layers.rpartition(".")[0])
        self.norm = getattr(backbone, "norm", None)
        if not isinstance(self.norm, nn.Module):
            raise ModelError(f"{source.spec}: no final norm at {arch_spec(self.model).layers.rpartition('.')[0]}"
                             ".norm, so its last hidden state cannot be computed layer by layer; run without "
                             "--stream-target")

    @property
    def config(self):
        return self.model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
        """The entries ``layers`` of transformers' ``hidden_states`` for ``input_ids`` [B, T]: 0 = embeddings, i =
        output of decoder layer i (the residual stream entering layer i + 1), the last (or -1) = the final norm's
        output. One pass over the shards."""
        count = len(decoder_layers(self.model))
        wanted = {i % (count + 1) for i in layers}
        inputs = capture_layer_inputs(self.model, input_ids, batch_size=len(input_ids))
        hidden, kwargs = inputs.hidden[0], inputs.kwargs[0]
        states = {0: hidden}
        for index in range(count):
            layer = read_layer(self.model, self.shards, index, self.dtype)
            out = layer(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            release_layer(layer)
            if index + 1 in wanted and index + 1 < count:
                states[index + 1] = hidden
        states[count] = self.norm(hidden)
        return [states[i % (count + 1)] for i in layers]
