"""W4A16 GEMM for the AWQ GEMM layout: ``y = x @ dequant(W).T`` with the int4 codes dequantized in registers.

Packed tensors (docs/formats.md §3; K = in_features, N = out_features, G = K/g groups, no act-order):

| tensor  | dtype          | shape     | content                                                                   |
|---------|----------------|-----------|---------------------------------------------------------------------------|
| qweight | int32          | [K, N/8]  | code of column n in word n // 8, nibble AWQ_REVERSE_ORDER[n % 8]          |
| qzeros  | int32          | [G, N/8]  | zero (0..15, stored as is), same interleave                               |
| scales  | fp16/bf16/fp32 | [G, N]    |                                                                           |

Dequant: ``W[n, k] = scales[k // g, n] · (q[k, n] − zero[k // g, n])``. The interleave ``[0, 2, 4, 6, 1, 3, 5, 7]``
(nibble i holds column 8c + order[i]) exists for AutoAWQ's CUDA dequant; here column n reads nibble
``(n % 8) // 2 + 4 · (n % 2)``, which is ``AWQ_REVERSE_ORDER[n % 8]`` in closed form.

Unlike GPTQ, the packed dimension is the output one, so a K tile loads each word once for its 8 columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from toolkit.kernels._launch import autotuned, check_activation, check_device, check_tensor, groups, launch
from toolkit.kernels._tiles import dequant_dot, store_tile

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, y_ptr,  # g_ptr unused: AWQ has no g_idx
    M, N, K, group_size, M_BUCKET,
    stride_xm, stride_xk,
    stride_qk, stride_qn,  # qweight [K, N/8]
    stride_zg, stride_zn,  # qzeros [G, N/8]
    stride_sg, stride_sn,  # scales [G, N]
    stride_ym, stride_yn,
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
    j = offs_n % 8
    shift = ((j // 2) + 4 * (j % 2)) * 4  # bit offset of column n's nibble, for qweight and qzeros alike

    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_k = (pid_k * tiles_per_split + t) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_kn = mask_k[:, None] & mask_n[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        words = tl.load(qw_ptr + offs_k[:, None] * stride_qk + (offs_n // 8)[None, :] * stride_qn,
                        mask=mask_kn, other=0)  # (BLOCK_K, BLOCK_N), each word read by its 8 columns
        q = (words >> shift[None, :]) & 0xF
        g = offs_k // group_size
        scale = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                        mask=mask_kn, other=0.0).to(tl.float32)  # masked rows get scale 0 → weight 0
        zwords = tl.load(qz_ptr + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn, mask=mask_kn, other=0)
        zero = (zwords >> shift[None, :]) & 0xF
        acc = dequant_dot(acc, x, q, zero, scale, DOT_FP32)
    store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn, SPLIT_K)


_TUNED = autotuned(_awq_kernel)


def awq_w4a16(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """``x @ W.T`` for an AWQ GEMM 4-bit linear: x [..., K] fp16/bf16/fp32 → y [..., N] in x's dtype (fp32 accumulation)."""
    layout = "awq_w4a16"
    if qweight.dim() != 2:
        raise ValueError(f"{layout}: qweight must be 2-D [K, N/8], got shape {tuple(qweight.shape)}")
    K, N = qweight.shape[0], qweight.shape[-1] * 8
    G = groups(K, group_size, layout)
    check_activation(x, K, layout)
    check_tensor(qweight, "qweight", (K, N // 8), (torch.int32,), layout)
    check_tensor(qzeros, "qzeros", (G, N // 8), (torch.int32,), layout)
    check_tensor(scales, "scales", (G, N), SCALE_DTYPES, layout)
    check_device(_awq_kernel, x, [qweight, qzeros, scales], layout)
    return launch(
        _awq_kernel, _TUNED, x, N, K, group_size,
        operands=(qweight, qzeros, scales, scales),
        strides=(*qweight.stride(), *qzeros.stride(), *scales.stride()),
    )
