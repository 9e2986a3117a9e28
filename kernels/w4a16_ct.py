"""W4A16 GEMM for the compressed-tensors ``pack-quantized`` layout, run by the GPTQ kernel.

Packed tensors (docs/formats.md §4; K = in_features, N = out_features, G groups):

| tensor            | dtype          | shape    | content                                                   |
|-------------------|----------------|----------|-----------------------------------------------------------|
| weight_packed     | int32          | [N, K/8] | code q + 8 of column k in nibble k % 8 of word k // 8      |
| weight_scale      | fp16/bf16/fp32 | [N, G]   |                                                           |
| weight_zero_point | int32          | [N/8, G] | zp + 8 of row n in nibble n % 8 of word n // 8 (asym only) |
| weight_g_idx      | int32          | [K]      | only with ``actorder: "group"``                           |

Why the GPTQ kernel is exact here: with unsigned codes c = q + 8 and zeros z = zp + 8, CT dequantizes
``(q − zp)·s = (c − z)·s``, the GPTQ formula. ``weight_packed.T`` is a GPTQ ``qweight`` [K/8, N] (sequential along K),
``weight_scale.T`` is ``scales`` [G, N], ``weight_zero_point.T`` is a v2 ``qzeros`` [G, N/8] (sequential along N), and
symmetric CT is zero 8 everywhere. The transposes are stride swaps the kernel reads directly: no copy, no repack.
"""

from __future__ import annotations

import torch

from toolkit.kernels._launch import autotuned, check_activation, check_device, check_tensor, groups, launch
from toolkit.kernels.w4a16_gptq import SCALE_DTYPES, _gptq_kernel

# Own tuning cache: the transposed reads favour other tiles than GPTQ's at the same (M bucket, N, K).
_TUNED = autotuned(_gptq_kernel)


def ct_w4a16(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
             weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for a compressed-tensors W4A16 linear: x [..., K] → y [..., N] in x's dtype (fp32 accumulation).

    ``weight_zero_point`` None means symmetric; ``g_idx`` None means group k // group_size.
    """
    layout = "ct_w4a16"
    if weight_packed.dim() != 2:
        raise ValueError(f"{layout}: weight_packed must be 2-D [N, K/8], got shape {tuple(weight_packed.shape)}")
    N, K = weight_packed.shape[0], weight_packed.shape[1] * 8
    if N % 8:
        raise ValueError(f"{layout}: N = {N} is not a multiple of 8; padded zero points are not supported")
    G = groups(K, group_size, layout)
    check_activation(x, K, layout)
    check_tensor(weight_packed, "weight_packed", (N, K // 8), (torch.int32,), layout)
    check_tensor(weight_scale, "weight_scale", (N, G), SCALE_DTYPES, layout)
    tensors = [weight_packed, weight_scale]
    if weight_zero_point is not None:
        check_tensor(weight_zero_point, "weight_zero_point", (N // 8, G), (torch.int32,), layout)
        tensors.append(weight_zero_point)
    if g_idx is not None:
        check_tensor(g_idx, "g_idx", (K,), (torch.int32, torch.int64), layout)
        tensors.append(g_idx)
    check_device(_gptq_kernel, x, tensors, layout)
    qweight = weight_packed.t()  # (K/8, N) view
    scales = weight_scale.t()  # (G, N) view
    qzeros = weight_packed if weight_zero_point is None else weight_zero_point.t()  # (G, N/8) view; unused if sym
    return launch(
        _gptq_kernel, _TUNED, x, N, K, group_size,
        operands=(qweight, qzeros, scales, scales if g_idx is None else g_idx),
        strides=(*qweight.stride(), *qzeros.stride(), *scales.stride()),
        ZERO_OFFSET=0, HAS_ZEROS=weight_zero_point is not None, HAS_G_IDX=g_idx is not None,
    )
