"""Torch oracle for the W4A16 kernels: pack, unpack and dequantize the three 4-bit layouts, then matmul in fp32.

Written straight from docs/formats.md §1–§4 and deliberately independent of ``toolkit.formats`` (the tests check the
two against each other, and both against hand-built golden words). K = in_features, N = out_features, g = group
size (-1: one group per output channel), G = K/g groups. Every packed word is int32 and holds eight 4-bit codes;
nibble i sits at bits [4i, 4i+4).

| layout | tensor              | dtype     | shape       | packed along | nibble i holds                     |
|--------|---------------------|-----------|-------------|--------------|------------------------------------|
| GPTQ   | ``qweight``         | int32     | [K/8, N]    | input (K)    | row k = 8r + i                     |
| GPTQ   | ``qzeros``          | int32     | [G, N/8]    | output (N)   | col n = 8c + i; v1 stores zero − 1 |
| GPTQ   | ``scales``          | fp16      | [G, N]      |              |                                    |
| GPTQ   | ``g_idx``           | int32     | [K]         |              | group of input column k            |
| AWQ    | ``qweight``         | int32     | [K, N/8]    | output (N)   | col n = 8c + [0,2,4,6,1,3,5,7][i]  |
| AWQ    | ``qzeros``          | int32     | [G, N/8]    | output (N)   | same interleave, zero as is        |
| AWQ    | ``scales``          | fp16      | [G, N]      |              | group of column k is k // g        |
| CT     | ``weight_packed``   | int32     | [N, K/8]    | input (K)    | col k = 8c + i, code q + 8         |
| CT     | ``weight_scale``    | fp16/bf16 | [N, G]      |              |                                    |
| CT     | ``weight_zero_point``| int32    | [N/8, G]    | output (N)   | row n = 8r + i, zp + 8 (asym only) |
| CT     | ``weight_g_idx``    | int32     | [K]         |              | only with ``actorder: "group"``    |

Every layout dequantizes to ``W[n, k] = scale[group(k), n] · (code[k, n] − zero[group(k), n])`` with unsigned codes
and zeros in 0..15 (CT's signed q and zp are the unsigned ones minus 8; symmetric CT has zero 8).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of nibble i


# ---- words <-> nibbles ------------------------------------------------------------------------------------------


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [...] → their eight nibbles [..., 8] (int32 0..15), nibble i from bits [4i, 4i+4).

    The mask after the shift matters: words with bit 31 set are negative and ``>>`` sign-extends.
    """
    return (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF


def words_from_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 8] (0..15) → int32 words [...] with code i in bits [4i, 4i+4) (two's complement above 2^31)."""
    if codes.shape[-1] != 8:
        raise ValueError(f"a 4-bit word holds 8 codes, got a last dim of {codes.shape[-1]}")
    words = (codes.to(torch.int64) << _SHIFTS.to(torch.int64).to(codes.device)).sum(-1)  # [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _group_index(K: int, group_size: int, device=None) -> torch.Tensor:
    """Group of every input column without act-order: k // g, or 0 for per-channel (g = -1)."""
    k = torch.arange(K, device=device)
    return torch.zeros_like(k) if group_size == -1 else k // group_size


# ---- GPTQ -------------------------------------------------------------------------------------------------------


def pack_gptq(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor,
              zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ tensors from codes [N, K] (0..15), scale [N, G], zero [N, G] (0..15), g_idx [K].

    ``zero_offset`` is what the checkpoint subtracts from the zero: 1 for v1 (``checkpoint_format: "gptq"``), 0 for v2.
    """
    N, K = codes.shape
    q = codes.t().reshape(K // 8, 8, N).transpose(1, 2)  # (K, N) → (K/8, N, 8): nibble i = row 8r + i
    z = ((zero.t().to(torch.int64) - zero_offset) & 0xF).reshape(-1, N // 8, 8)  # (G, N) → (G, N/8, 8)
    return {
        "qweight": words_from_nibbles(q),  # (K/8, N)
        "qzeros": words_from_nibbles(z),  # (G, N/8)
        "scales": scale.t().to(torch.float16).contiguous(),  # (G, N)
        "g_idx": g_idx.to(torch.int32),
    }


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    zero_offset: int = 1) -> torch.Tensor:
    """Float32 W [N, K] from GPTQ tensors; ``zero_offset`` 1 for v1 zeros (stored zero − 1), 0 for v2."""
    K8, N = qweight.shape
    q = nibbles(qweight).transpose(1, 2).reshape(K8 * 8, N)  # (K/8, N, 8) → (K/8, 8, N) → (K, N)
    z = nibbles(qzeros).reshape(qzeros.shape[0], N) + zero_offset  # (G, N/8, 8) → (G, N)
    g = g_idx.long()
    return (scales.float()[g] * (q - z[g]).float()).t()  # (K, N) → (N, K)


# ---- AWQ GEMM ---------------------------------------------------------------------------------------------------


def pack_awq(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors from codes [N, K], scale [N, G], zero [N, G] (groups k // g, no act-order)."""
    N, K = codes.shape
    order = list(AWQ_ORDER)
    q = codes.t().reshape(K, N // 8, 8)[..., order]  # (K, N/8, 8): nibble i = column 8c + AWQ_ORDER[i]
    z = zero.t().reshape(-1, N // 8, 8)[..., order]  # (G, N/8, 8)
    return {
        "qweight": words_from_nibbles(q),  # (K, N/8)
        "qzeros": words_from_nibbles(z),  # (G, N/8)
        "scales": scale.t().to(torch.float16).contiguous(),  # (G, N)
    }


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 W [N, K] from AWQ GEMM tensors."""
    K, N8 = qweight.shape
    reverse = list(AWQ_REVERSE_ORDER)
    q = nibbles(qweight)[..., reverse].reshape(K, N8 * 8)  # (K, N/8, 8) in column order → (K, N)
    z = nibbles(qzeros)[..., reverse].reshape(qzeros.shape[0], N8 * 8)  # (G, N)
    g = _group_index(K, group_size, qweight.device)
    return (scales.float()[g] * (q - z[g]).float()).t()  # (K, N) → (N, K)


# ---- compressed-tensors pack-quantized --------------------------------------------------------------------------


def pack_ct(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
            scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """CT tensors from unsigned codes [N, K] (= signed q + 8), scale [N, G], unsigned zero [N, G] or None (sym)."""
    N, K = codes.shape
    tensors = {
        "weight_packed": words_from_nibbles(codes.reshape(N, K // 8, 8)),  # (N, K/8): nibble i = column 8c + i
        "weight_scale": scale.to(scale_dtype).contiguous(),  # (N, G)
    }
    if zero is not None:
        z = zero.reshape(N // 8, 8, -1).transpose(1, 2)  # (N, G) → (N/8, G, 8): nibble i = row 8r + i
        tensors["weight_zero_point"] = words_from_nibbles(z)  # (N/8, G)
    return tensors


def dequantize_ct(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                  weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 W [N, K] from compressed-tensors tensors; no zero point means symmetric (unsigned zero 8)."""
    N, K8 = weight_packed.shape
    c = nibbles(weight_packed).reshape(N, K8 * 8)  # (N, K/8, 8) → (N, K)
    if weight_zero_point is None:
        z = torch.full_like(weight_scale, 8, dtype=torch.int32)  # (N, G)
    else:
        z = nibbles(weight_zero_point).transpose(1, 2).reshape(N, -1)  # (N/8, G, 8) → (N/8, 8, G) → (N, G)
    g = _group_index(K8 * 8, group_size, weight_packed.device) if g_idx is None else g_idx.long()
    return weight_scale.float()[:, g] * (c - z[:, g]).float()


# ---- matmul -----------------------------------------------------------------------------------------------------


def w4a16_matmul_reference(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in fp32 (x [..., K], W [N, K]), returned in x's dtype: what every kernel must approximate."""
    return (x.float() @ W.float().t()).to(x.dtype)


# ---- how close is close -----------------------------------------------------------------------------------------

# Bound on ``max_relative_error`` of a correct W4A16 kernel (fp32 accumulation) against the oracle, by activation
# dtype: the weight is rounded to that dtype before the multiply and the output once after. A wrong nibble order
# or group index errs by O(0.1–1), far above these.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}


def max_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y − ref| / max |ref|, in fp32: one number per output, insensitive to where ref crosses zero."""
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
