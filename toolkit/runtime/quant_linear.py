"""``QuantLinear``: a linear layer that holds packed integer weights and runs from them.

The reference path unpacks the codes and multiplies in float (dequantize-then-matmul): the oracle every faster
path is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.formats import gptq


class QuantLinear(nn.Module):
    """A GPTQ-layout W4A16 (or other bit width) linear: buffers qweight, qzeros, scales, g_idx [, bias]."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = 1 if group_size == -1 else in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.zeros(groups, out_features * bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16) if bias else None)

    def packed(self) -> dict[str, torch.Tensor]:
        """The packed tensors by suffix, as the format module reads them."""
        return {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight [N, K]."""
        return gptq.dequantize(self.packed(), self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        W = self.dequantized_weight().to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, W, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group_size={self.group_size}"
