"""W4A16 on CPU through torch's own int4 kernel (``aten::_weight_int4pack_mm_for_cpu``), no Triton, no dense weight.

torch's convention (the "tinygemm" one, shared with ``_weight_int4pack_mm`` on CUDA): unsigned codes q in 0..15 and,
per (group, output channel), a pair (scale, zero) in ``qScaleAndZeros`` [G, N, 2] with

    W[n, k] = (q[n, k] − 8) · scale + zero            ← torch: "zero" is an additive offset in float, not a code

GPTQ, AWQ and compressed-tensors all store the integer zero point z (CT: zp + 8) with W = scale · (q − z), so

    scale · (q − z) = (q − 8) · scale + (8 − z) · scale   ⇒   torch_scale = scale,  torch_zero = (8 − z) · scale

(symmetric: z = 8 ⇒ torch_zero = 0). ``tests/kernels/test_cpu_int4.py`` proves it by multiplying the identity.

Limits of the op in torch 2.13, and how ``prepare_int4_cpu`` meets them:

| op requirement                                   | here                                                             |
|--------------------------------------------------|------------------------------------------------------------------|
| ``qGroupSize`` ∈ {32, 64, 128, 256}              | a group of g = 96, 192, … or per-channel (g = K) is cut into g/32.. sub-groups sharing its scale; g must be a multiple of 32 |
| N divisible by 16                                | rows padded with zero scale (output columns sliced off)          |
| codes int32 [N, K] in 0..15 → uint8 [N, K/2]     | ``_convert_weight_to_int4pack_for_cpu`` (its ``innerKTiles`` is ignored on CPU) |
| ``qScaleAndZeros`` dtype = x dtype (fp32/bf16/fp16) | kept in fp32, cast once per compute dtype and cached          |
| fast only in bf16 (fp32/fp16 x: scalar fallback)  | ``int4_mm_cpu`` computes in bf16 by default, returns x's dtype   |
| groups contiguous along K                        | act-order: columns sorted by ``g_idx`` and x permuted to match (``x[:, perm]``), valid when every group has exactly ``group_size`` columns, as GPTQ ``desc_act`` makes them; otherwise refused |

Precision: in bf16 (the default compute dtype) x is rounded to bf16 and the torch zero (8 − z)·scale is stored in
bf16, an error of at most |8 − z|·scale·2⁻⁹ ≤ 1/64 of a quantization step per weight; ``compute_dtype=torch.float32``
is exact to fp32 rounding (the tests' identity proof runs that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TORCH_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"


@dataclass
class Int4CpuWeight:
    """One linear packed for torch's CPU int4 mm.

    packed uint8 [N_pad, K/2]; scale_and_zero fp32 [K/torch_group_size, N_pad, 2]; perm int64 [K] or None
    (input-column order the groups are contiguous in); N, K the true output/input widths.
    """

    packed: torch.Tensor
    scale_and_zero: torch.Tensor
    torch_group_size: int
    N: int
    K: int
    perm: torch.Tensor | None = None
    _cast: dict = field(default_factory=dict, repr=False)  # compute dtype → scale_and_zero in that dtype

    def scale_and_zero_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.scale_and_zero.to(dtype).contiguous()
        return self._cast[dtype]


def _torch_scale_and_zero(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, integer zero z) with W = scale·(q − z) → torch's (scale, additive zero) with W = (q − 8)·scale + zero."""
    scale = scale.double()
    return scale.float(), ((8 - zero.double()) * scale).float()


def _torch_group_size(group_size: int, K: int) -> int:
    size = K if group_size == -1 else group_size
    for candidate in TORCH_GROUP_SIZES:
        if size % candidate == 0:
            return candidate
    raise ValueError(
        f"torch's CPU int4 kernel takes groups of 32, 64, 128 or 256 columns; a group of {size} "
        f"({'per channel, K' if group_size == -1 else 'group_size'} = {size}) is not a multiple of 32. "
        "Quantize with group_size 32/64/128, or run the dequantized weight with torch.matmul"
    )


def _act_order_perm(g_idx: torch.Tensor, group_size: int, K: int, G: int) -> torch.Tensor | None:
    """Column order in which each group is contiguous, or None when g_idx is already k // group_size."""
    g_idx = g_idx.long().cpu()
    if group_size == -1 or torch.equal(g_idx, torch.arange(K) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=G)
    if g_idx.min() < 0 or len(counts) != G or not bool((counts == group_size).all()):
        raise ValueError(
            f"g_idx does not put exactly {group_size} columns in each of the {G} groups (counts {counts.tolist()[:8]}...), "
            "so no column permutation makes the groups contiguous; run this layer with the dequantized weight instead"
        )
    return torch.argsort(g_idx, stable=True)


def prepare_int4_cpu(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                     g_idx: torch.Tensor | None = None) -> Int4CpuWeight:
    """Pack one linear for ``int4_mm_cpu``.

    codes [N, K] uint8 (0..15), scale [N, G] float, zero [N, G] integer zero point (W = scale·(code − zero), the
    ``QuantizedWeight`` convention: GPTQ zero after the v1 +1, AWQ zero as stored, CT zp + 8 or 8 when symmetric),
    group_size (-1: per channel), g_idx [K] optional (act-order).
    """
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    N, K = codes.shape
    G = 1 if group_size == -1 else K // max(group_size, 1)
    if group_size != -1 and (group_size <= 0 or K % group_size):
        raise ValueError(f"group_size {group_size} does not divide K = {K}; pass -1 (per channel) or a divisor of K")
    if tuple(scale.shape) != (N, G) or tuple(zero.shape) != (N, G):
        raise ValueError(f"scale and zero must be [N, G] = [{N}, {G}], got {tuple(scale.shape)} and {tuple(zero.shape)}")
    if codes.dtype.is_floating_point or int(codes.max()) > 15 or int(codes.min()) < 0:
        raise ValueError("codes must be integers in 0..15 (unsigned 4-bit); CT's signed q must be passed as q + 8")
    torch_group_size = _torch_group_size(group_size, K)
    perm = None if g_idx is None else _act_order_perm(g_idx, group_size, K, G)

    codes = codes.to(torch.int32)
    if perm is not None:
        codes = codes[:, perm]  # (N, K) with groups contiguous
    torch_scale, torch_zero = _torch_scale_and_zero(scale.float(), zero)  # (N, G)
    repeat = (K if group_size == -1 else group_size) // torch_group_size
    torch_scale = torch_scale.repeat_interleave(repeat, dim=1)  # (N, K / torch_group_size)
    torch_zero = torch_zero.repeat_interleave(repeat, dim=1)

    pad = -N % _N_MULTIPLE  # padded rows: code 8, scale 0, zero 0 → weight 0
    if pad:
        codes = torch.cat([codes, torch.full((pad, K), 8, dtype=torch.int32)])
        torch_scale = torch.cat([torch_scale, torch.zeros(pad, torch_scale.shape[1])])
        torch_zero = torch.cat([torch_zero, torch.zeros(pad, torch_zero.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # (N_pad, K/2) uint8
    scale_and_zero = torch.stack([torch_scale.t(), torch_zero.t()], dim=-1).contiguous()  # (G', N_pad, 2)
    return Int4CpuWeight(packed, scale_and_zero, torch_group_size, N, K, perm)


def int4_mm_cpu(x: torch.Tensor, weight: Int4CpuWeight, compute_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """``x @ W.T`` for x [..., K] fp32/bf16/fp16 on CPU → y [..., N] in x's dtype.

    ``compute_dtype``: the dtype the op runs in (x and the scales are cast to it). bf16, the default, is torch's
    vectorized path; fp32 and fp16 run a scalar fallback, 50–300× slower (AVX512-BF16 EPYC, one thread, 4096→4096
    at M = 1: 87 ms in fp32 vs 0.45 ms in bf16), so pass ``None`` (x's own dtype) only when fp32 exactness matters
    more than speed.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[-1] != weight.K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects K = {weight.K}")
    if x.device.type != "cpu":
        raise ValueError(f"int4_mm_cpu runs on CPU tensors; x is on {x.device} (use toolkit.kernels on CUDA)")
    dtype = x.dtype if compute_dtype is None else compute_dtype
    x2 = x.reshape(-1, weight.K)  # (M, K)
    if weight.perm is not None:
        x2 = x2[:, weight.perm]  # same column order as the packed codes
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(dtype).contiguous(), weight.packed, weight.torch_group_size, weight.scale_and_zero_for(dtype)
    )  # (M, N_pad)
    return y[:, : weight.N].to(x.dtype).reshape(*x.shape[:-1], weight.N)
