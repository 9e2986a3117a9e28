"""Group-wise integer quantization primitives shared by every method.

The grid is the GPTQ/AutoGPTQ one (IST-DASLab/gptq ``quant.py``), which the GPTQ, AWQ and compressed-tensors
formats can all represent:

  maxq = 2^bits − 1
  symmetric:  scale = 2·amax / maxq,           zero = 2^(bits−1)
  asymmetric: scale = (max − min) / maxq,      zero = round(−min / scale)      (min ≤ 0 ≤ max: range widened to 0)
  code = clamp(round(W / scale) + zero, 0, maxq);   Ŵ = scale · (code − zero)

Groups run along the input dimension: column k belongs to group ``g_idx[k]``.

``ScaleRule`` changes two things for a target that needs them (GGUF, ``GGUF_RULE``):
  signed_max: symmetric scale = x_ext / −2^(bits−1), x_ext the group's value of largest magnitude (llama.cpp's
              ``quantize_row_q4_0_ref``: d = max / −8). x_ext lands exactly on code 0 and all 2^bits codes are used;
              the scale is negative when x_ext is positive. The GPTQ rule above puts ±amax at ±(2^(bits−1) − ½)
              steps, so its positive end clamps half a step short and code 0's step is spent on −amax alone.
  dtype:      the scale is rounded to this dtype (fp16 for GGUF, whose blocks store it so) before the zero and the
              codes are chosen, so the codes are the nearest ones on the grid that is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def max_code(bits: int) -> int:
    """Largest code of a ``bits``-wide unsigned integer."""
    return (1 << bits) - 1


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """Group of each input column without act-order: ``k // group_size`` (all zeros for per-channel)."""
    columns = torch.arange(in_features, dtype=torch.int32, device=device)
    if group_size == -1:
        return torch.zeros_like(columns)
    return columns // group_size


@dataclass(frozen=True)
class ScaleRule:
    """How a group's range becomes its scale beyond bits and sym (the module docstring): ``signed_max`` puts a
    symmetric group's largest-magnitude value exactly on code 0; ``dtype`` (None: float32) is the dtype scales are
    stored in, rounded to before codes are chosen."""

    signed_max: bool = False
    dtype: torch.dtype | None = None


GPTQ_RULE = ScaleRule()  # the GPTQ reference grid, every safetensors format's default
FULL_RANGE_RULE = ScaleRule(signed_max=True)  # a symmetric grid over all 2^bits codes (--full-range; AutoRound's)
GGUF_RULE = ScaleRule(signed_max=True, dtype=torch.float16)  # llama.cpp's Q4_0 rule, fp16 scales as its blocks store
GGUF_BLOCK_SIZE = 32  # weights per GGUF block (llama.cpp's QK4_0 = QK4_1 = QK8_0): the group size of a GGUF grid


def qparams_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, bits: int, sym: bool, rule: ScaleRule = GPTQ_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for ranges [xmin, xmax] (any matching shapes). Returns float scale, float zero (integral).

    With ``rule.signed_max`` the extreme is xmin when |xmin| ≥ xmax, else xmax (llama.cpp keeps the first of two
    equal magnitudes in its block; either choice leaves the other end one step outside the grid)."""
    maxq = max_code(bits)
    xmin = torch.minimum(xmin, torch.zeros_like(xmin))
    xmax = torch.maximum(xmax, torch.zeros_like(xmax))
    if sym:
        if rule.signed_max:
            extreme = torch.where(-xmin >= xmax, xmin, xmax)
            scale = extreme / -float(1 << (bits - 1))
        else:
            scale = 2 * torch.maximum(xmin.abs(), xmax) / maxq
    else:
        scale = (xmax - xmin) / maxq
    if rule.dtype is not None:
        scale = scale.to(rule.dtype).float()
    # An all-zero group (or one whose scale underflows the dtype): any scale reproduces it within the underflow;
    # 1 keeps the scale finite in fp16.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if sym:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        zero = torch.round(-xmin / scale)
    return scale, zero


def group_qparams(
    W: torch.Tensor, bits: int, group_size: int, sym: bool, rule: ScaleRule = GPTQ_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max scale and zero of every (row, contiguous group) of ``W`` [N, K] → scale, zero [N, G]."""
    N, K = W.shape
    size = K if group_size == -1 else group_size
    groups = W.float().reshape(N, K // size, size)  # (N, G, group_size)
    return qparams_from_range(groups.amin(dim=-1), groups.amax(dim=-1), bits, sym, rule)


def quantize(
    W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """Codes of ``W`` [N, K] on the grid (scale, zero) [N, G] chosen per column by ``g_idx`` [K] → uint8 [N, K]."""
    g = g_idx.long()
    q = torch.round(W.float() / scale[:, g]) + zero[:, g]
    return q.clamp_(0, max_code(bits)).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Float weights ``scale · (code − zero)`` [N, K] from codes [N, K] and per-group scale, zero [N, G].

    Computed in place in the output, so a linear costs one float32 copy (contiguous groups broadcast per group;
    act-order's ``g_idx`` expands one [N, K] operand at a time).
    """
    out = codes.float()
    N, K = codes.shape
    G = scale.shape[1]
    if K % G == 0 and torch.equal(g_idx.long(), default_g_idx(K, K // G, g_idx.device).long()):
        grouped = out.view(N, G, K // G)
        grouped.sub_(zero[:, :, None]).mul_(scale[:, :, None])
        return out
    g = g_idx.long()
    return out.sub_(zero[:, g]).mul_(scale[:, g])


@dataclass
class QuantizedWeight:
    """The result of quantizing one linear: everything a format writer needs, in plain tensors.

    codes uint8 [N, K], scale float32 [N, G], zero int32 [N, G], g_idx int32 [K], bias float [N] or None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    sym: bool
    bias: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """Float32 weight [N, K] this record stands for."""
        return dequantize(self.codes, self.scale, self.zero.float(), self.g_idx)

    def cpu(self) -> QuantizedWeight:
        """This record with every tensor in host memory (itself when they already are): what format writers take."""
        if self.codes.device.type == "cpu":
            return self
        bias = None if self.bias is None else self.bias.cpu()
        return replace(self, codes=self.codes.cpu(), scale=self.scale.cpu(), zero=self.zero.cpu(),
                       g_idx=self.g_idx.cpu(), bias=bias)


def quantize_rtn(
    W: torch.Tensor, bits: int, group_size: int, sym: bool, bias: torch.Tensor | None = None,
    rule: ScaleRule = GPTQ_RULE,
) -> QuantizedWeight:
    """Round-to-nearest on min/max ranges per group: the baseline every other method must beat."""
    scale, zero = group_qparams(W, bits, group_size, sym, rule)
    g_idx = default_g_idx(W.shape[1], group_size, W.device)
    codes = quantize(W, scale, zero, g_idx, bits)
    return QuantizedWeight(codes, scale, zero.to(torch.int32), g_idx, bits, group_size, sym, bias)
