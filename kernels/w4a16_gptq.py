"""W4A16 GEMM for the GPTQ layout: ``y = x @ dequant(W).T`` with the int4 codes dequantized in registers.

Packed tensors (docs/formats.md §2; K = in_features, N = out_features, G groups):

| tensor    | dtype          | shape     | content                                                        |
|-----------|----------------|-----------|----------------------------------------------------------------|
| qweight   | int32          | [K/8, N]  | code of row k in nibble k % 8 of word k // 8 (sequential)       |
| qzeros    | int32          | [G, N/8]  | zero of column n in nibble n % 8 of word n // 8; v1: zero − 1   |
| scales    | fp16/bf16/fp32 | [G, N]    |                                                                |
| g_idx     | int32          | [K]       | group of input row k (any order: act-order, ``desc_act``)       |

Dequant: ``W[n, k] = scales[g_idx[k], n] · (q[k, n] − zero[g_idx[k], n])``. The group is gathered per input row,
so a non-monotonic act-order ``g_idx`` costs no reordering of x or the weight (the gathered scale rows stay in
L1/L2: a K tile touches at most a few groups, or a few dozen with act-order).

The same kernel runs the compressed-tensors layout (``w4a16_ct.py``): its ``weight_packed`` [N, K/8] is this
``qweight`` transposed, which the kernel reads through strides without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from toolkit.kernels._launch import autotuned, check_activation, check_device, check_tensor, groups, launch
from toolkit.kernels._tiles import dequant_dot, store_tile

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gptq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,
    M, N, K, group_size, M_BUCKET,
    stride_xm, stride_xk,
    stride_qk, stride_qn,  # qweight [K/8, N]
    stride_zg, stride_zn,  # qzeros [G, N/8]
    stride_sg, stride_sn,  # scales [G, N]
    stride_ym, stride_yn,
    ZERO_OFFSET: tl.constexpr,  # added to the stored zero: 1 for GPTQ v1, 0 for v2 and CT
    HAS_ZEROS: tl.constexpr,  # False: symmetric, zero 8 (CT without weight_zero_point)
    HAS_G_IDX: tl.constexpr,  # False: group of row k is k // group_size
    DOT_FP32: tl.constexpr,  # multiply in fp32 (see _launch.launch)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    zero_shift = (offs_n % 8) * 4  # nibble of column n in its qzeros word

    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_k = (pid_k * tiles_per_split + t) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        words = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_kn, other=0)  # (BLOCK_K, BLOCK_N), each word read by its 8 rows
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
        else:
            g = offs_k // group_size
        scale = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                        mask=mask_kn, other=0.0).to(tl.float32)  # masked rows get scale 0 → weight 0
        if HAS_ZEROS:
            zwords = tl.load(qz_ptr + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn, mask=mask_kn, other=0)
            zero = ((zwords >> zero_shift[None, :]) & 0xF) + ZERO_OFFSET
        else:
            zero = 8
        acc = dequant_dot(acc, x, q, zero, scale, DOT_FP32)
    store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn, SPLIT_K)


_TUNED = autotuned(_gptq_kernel)


def gptq_w4a16(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, group_size: int, *, checkpoint_format: str = "gptq") -> torch.Tensor:
    """``x @ W.T`` for a GPTQ 4-bit linear: x [..., K] fp16/bf16/fp32 → y [..., N] in x's dtype (fp32 accumulation).

    ``checkpoint_format``: ``"gptq"`` (v1, qzeros store zero − 1) or ``"gptq_v2"`` (qzeros store the zero).
    """
    layout = "gptq_w4a16"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"{layout}: checkpoint_format must be 'gptq' (v1 zeros) or 'gptq_v2', got {checkpoint_format!r}")
    if qweight.dim() != 2:
        raise ValueError(f"{layout}: qweight must be 2-D [K/8, N], got shape {tuple(qweight.shape)}")
    N = qweight.shape[-1]
    K = qweight.shape[0] * 8
    if N % 8:
        raise ValueError(f"{layout}: N = {N} is not a multiple of 8, so qzeros cannot pack it")
    G = groups(K, group_size, layout)
    check_activation(x, K, layout)
    check_tensor(qweight, "qweight", (K // 8, N), (torch.int32,), layout)
    check_tensor(qzeros, "qzeros", (G, N // 8), (torch.int32,), layout)
    check_tensor(scales, "scales", (G, N), SCALE_DTYPES, layout)
    check_tensor(g_idx, "g_idx", (K,), (torch.int32, torch.int64), layout)
    check_device(_gptq_kernel, x, [qweight, qzeros, scales, g_idx], layout)
    return launch(
        _gptq_kernel, _TUNED, x, N, K, group_size,
        operands=(qweight, qzeros, scales, g_idx),
        strides=(*qweight.stride(), *qzeros.stride(), *scales.stride()),
        ZERO_OFFSET=1 if checkpoint_format == "gptq" else 0, HAS_ZEROS=True, HAS_G_IDX=True,
    )
