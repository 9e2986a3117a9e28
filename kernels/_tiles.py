"""The tile steps every W4A16 kernel body shares, as ``@triton.jit`` helpers (inlined into the caller's kernel).

A kernel's own code is only what its layout decides: where a K tile's codes, zeros and scales are read from. Each
tile then goes through ``dequant_dot`` (codes to x's dtype, multiplied into the fp32 accumulator), and the finished
accumulator through ``store_tile`` (written in y's dtype, or added into the fp32 split-K buffer).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_dot(acc, x, q, zero, scale, DOT_FP32: tl.constexpr):
    """``acc + x @ ((q − zero) · scale)`` for one K tile: x (BLOCK_M, BLOCK_K), q / zero / scale (BLOCK_K, BLOCK_N).

    The weight is dequantized in fp32 and rounded once to x's dtype; ``DOT_FP32`` multiplies in fp32 (IEEE) instead
    of x's dtype (see ``_launch.launch``).
    """
    w = ((q - zero).to(tl.float32) * scale).to(x.dtype)
    if DOT_FP32:
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def store_tile(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, stride_yn, SPLIT_K: tl.constexpr):
    """Write the (BLOCK_M, BLOCK_N) tile of y: stored in y's dtype, or with split-K added into y (fp32)."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_mn)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask_mn)
