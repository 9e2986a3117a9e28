"""``QuantLinear``: a linear layer that holds one checkpoint format's packed integer weights and runs from them.

The buffers are the format's tensors under their on-disk suffixes (GPTQ ``qweight``/``qzeros``/``scales``/``g_idx``,
AWQ ``qweight``/``qzeros``/``scales``, compressed-tensors ``weight_packed``/``weight_scale``/``weight_shape``
[/``weight_zero_point``]), so a checkpoint's state dict loads without renaming. ``layout`` is the format module
(``toolkit.formats.gptq`` / ``awq`` / ``compressed_tensors``) that knows how to read them.

The reference path unpacks the codes and multiplies in float (dequantize-then-matmul): the oracle every faster
path is tested against.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class QuantLinear(nn.Module):
    """A weight-only quantized linear: ``packed`` tensors of ``layout``'s format [, bias], ``y = x Ŵᵀ + b``.

    packed: {suffix: tensor} as the format writes them (placeholders of the right shape and dtype are enough; a
    ``load_state_dict(..., assign=True)`` then fills them).
    """

    def __init__(
        self,
        layout: ModuleType,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        packed: dict[str, torch.Tensor],
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.layout = layout
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.suffixes = tuple(packed)
        for suffix, tensor in packed.items():
            self.register_buffer(suffix, tensor)
        self.register_buffer("bias", bias)

    def packed(self) -> dict[str, torch.Tensor]:
        """The packed tensors by suffix, as the format module reads them."""
        return {suffix: getattr(self, suffix) for suffix in self.suffixes}

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight [N, K]."""
        return self.layout.dequantize(self.packed(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        W = self.dequantized_weight().to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, W, bias)

    def extra_repr(self) -> str:
        return (f"layout={self.layout.NAME}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}")
