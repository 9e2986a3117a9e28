"""compound's group-32 codes and scales as llama.cpp's GGUF block bytes, and the torch reader of those bytes.

Every block covers 32 consecutive input columns of one output row; a row of K columns is K/32 blocks, back to back.
All fp16 fields are little endian.

| type | bytes | layout                               | weight                 | from compound's grid             |
|------|-------|--------------------------------------|------------------------|----------------------------------|
| Q4_0 | 18    | d fp16, qs uint8[16]                 | w = d·(q − 8)          | 4-bit sym: d = scale, q = code   |
| Q4_1 | 20    | d fp16, m fp16, qs uint8[16]         | w = d·q + m            | 4-bit asym: d = scale, q = code, |
|      |       |                                      |                        | m = fp16(−scale·zero)            |
| Q8_0 | 34    | d fp16, qs int8[32]                  | w = d·q                | 8-bit sym: d = scale, q = code − 128 |

4-bit nibble order: ``qs[j] = q[j] | (q[j + 16] << 4)`` for j in 0..15 (the low nibbles hold the block's first
half, the high nibbles its second half).

Exactness. ``scale`` must already be an fp16 value (the quantizers round it when the target is GGUF); ``pack``
refuses one that is not, since re-rounding it would change every weight of the group. (q − 8)·d and q·d are
exact in float32 (a ≤ 8-bit integer times an 11-bit mantissa), so Q4_0 and Q8_0 decode to
``QuantizedWeight.dequantize()`` bit for bit. Q4_1 stores the minimum m = −scale·zero in fp16:
|Δw| ≤ half an fp16 ulp of |m|, the same order as an fp16 kernel's own (q − z)·s product. The sum d·q + m is
exact in float32 (both terms are multiples of the scale's ulp and under 2^16 of them), so llama.cpp's
``x0*d + m`` gives the same float with or without a fused multiply-add.

Sources (llama.cpp, ggml-org/llama.cpp and its forks, read through the code search index):
``ggml/src/ggml-common.h`` ``block_q4_0 {ggml_half d; uint8_t qs[QK4_0/2];}``,
``block_q4_1 {ggml_half d; ggml_half m; uint8_t qs[QK4_1/2];}``, ``block_q8_0 {ggml_half d; int8_t qs[QK8_0];}``
with QK4_0 = QK4_1 = QK8_0 = 32; ``ggml/src/ggml-quants.c`` ``dequantize_row_q4_0`` (``x0 = (qs[j] & 0x0F) - 8``,
``x1 = (qs[j] >> 4) - 8``, ``y[j] = x0*d``, ``y[j + qk/2] = x1*d``) and ``dequantize_row_q4_1``
(``y = x0*d + m``); gguf-py ``gguf/quants.py`` (``Q4_0``, ``Q4_1``, ``Q8_0`` ``dequantize_blocks``).
"""

from __future__ import annotations

import torch

from toolkit.formats.scheme import FormatError
from toolkit.quant.primitives import GGUF_BLOCK_SIZE as BLOCK_SIZE  # weights per block, beside the GGUF scale rule
from toolkit.quant.primitives import QuantizedWeight, default_g_idx

# type name → bytes per block
BLOCK_BYTES = {"Q4_0": 2 + BLOCK_SIZE // 2, "Q4_1": 2 + 2 + BLOCK_SIZE // 2, "Q8_0": 2 + BLOCK_SIZE}

_FP16_MAX = 65504.0


def block_type(bits: int, sym: bool, group_size: int, act_order: bool = False) -> str:
    """The GGUF block type that stores a grid of these numerics exactly; FormatError naming the reason and the flag
    to change otherwise (checked before any weight is read)."""
    if group_size != BLOCK_SIZE:
        raise FormatError(f"GGUF blocks hold {BLOCK_SIZE} weights; group_size {group_size} cannot be written "
                          f"exactly: quantize with --group-size {BLOCK_SIZE}")
    if act_order:
        raise FormatError("GGUF blocks need contiguous groups of 32 columns; dynamic act-order permutes them: "
                          "quantize with --no-act-order or static groups")
    if bits == 4:
        return "Q4_0" if sym else "Q4_1"
    if bits == 8 and sym:
        return "Q8_0"
    if bits == 8:
        raise FormatError("GGUF has no asymmetric 8-bit block type (Q8_1 is activation-only): quantize 8-bit "
                          "weights with --sym")
    raise FormatError(f"GGUF export writes 4-bit (Q4_0/Q4_1) or 8-bit (Q8_0) grids, not {bits}-bit: "
                      f"quantize with --bits 4 or --bits 8")


def _type_of(qweight: QuantizedWeight) -> str:
    """The GGUF block type that stores ``qweight``'s grid exactly; FormatError naming the reason otherwise."""
    N, K = qweight.codes.shape
    permuted = K % BLOCK_SIZE or not torch.equal(qweight.g_idx.long(), default_g_idx(K, BLOCK_SIZE).long())
    name = block_type(qweight.bits, qweight.sym, qweight.group_size, bool(permuted))
    if qweight.sym and not bool((qweight.zero == 1 << (qweight.bits - 1)).all()):
        raise FormatError(f"a symmetric {qweight.bits}-bit grid must have zero {1 << (qweight.bits - 1)}; "
                          f"this weight's zeros differ")
    return name


def _fp16_exact(values: torch.Tensor, what: str) -> torch.Tensor:
    """``values`` as fp16, refusing any that fp16 does not hold exactly (re-rounding would move the weights)."""
    half = values.to(torch.float16)
    if not bool((half.float() == values.float()).all()):
        raise FormatError(f"{what} are not fp16 values, so GGUF would re-round them: quantize with fp16 scales "
                          f"(the GGUF target rounds them before choosing codes)")
    return half


def _half_bytes(half: torch.Tensor) -> torch.Tensor:
    """fp16 [...] → uint8 [..., 2], little endian whatever the host's byte order."""
    bits = half.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8)


def _bytes_half(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little endian → float32 [...] of the fp16 they hold."""
    bits = raw[..., 0].to(torch.int32) | (raw[..., 1].to(torch.int32) << 8)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # as a signed int16
    return bits.to(torch.int16).view(torch.float16).float()


def pack(qweight: QuantizedWeight) -> tuple[str, torch.Tensor]:
    """GGUF type name and block bytes uint8 [N, K/32·block_bytes] of ``qweight``, written from its own codes."""
    name = _type_of(qweight)
    N, K = qweight.codes.shape
    G = K // BLOCK_SIZE
    d = _fp16_exact(qweight.scale, "scales")  # (N, G)
    codes = qweight.codes.reshape(N, G, BLOCK_SIZE)  # (N, G, 32)
    fields = [_half_bytes(d)]  # (N, G, 2)
    if name == "Q8_0":
        q = codes.to(torch.int16) - 128  # int8 range [-128, 127]
        fields.append(q.to(torch.int8).view(torch.uint8))  # (N, G, 32)
    else:
        if name == "Q4_1":
            m = -(qweight.scale.float() * qweight.zero.float())  # exact in float32: 11-bit scale × 4-bit zero
            if bool((m.abs() > _FP16_MAX).any()):
                raise FormatError("a Q4_1 minimum −scale·zero exceeds the fp16 range; these weights cannot be "
                                  "written as Q4_1")
            fields.append(_half_bytes(m.to(torch.float16)))  # (N, G, 2)
        low, high = codes[..., : BLOCK_SIZE // 2], codes[..., BLOCK_SIZE // 2:]  # (N, G, 16) each
        fields.append(low | (high << 4))  # (N, G, 16)
    return name, torch.cat(fields, dim=-1).reshape(N, G * BLOCK_BYTES[name])


def dequantize(type_name: str, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Float32 [N, K] of GGUF ``type_name`` block bytes ``data`` uint8 [N, K/32·block_bytes]: llama.cpp's decode."""
    if type_name not in BLOCK_BYTES:
        raise FormatError(f"GGUF block type {type_name!r} is not read; expected one of {', '.join(BLOCK_BYTES)}")
    N, K = shape
    G = K // BLOCK_SIZE
    blocks = data.reshape(N, G, BLOCK_BYTES[type_name])  # (N, G, block_bytes)
    d = _bytes_half(blocks[..., 0:2])[..., None]  # (N, G, 1)
    if type_name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # (N, G, 32)
        return (d * q).reshape(N, K)
    qs = blocks[..., -BLOCK_SIZE // 2:]  # (N, G, 16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # (N, G, 32): low nibbles first
    if type_name == "Q4_0":
        return (d * (q - 8)).reshape(N, K)
    m = _bytes_half(blocks[..., 2:4])[..., None]  # (N, G, 1)
    return (d * q + m).reshape(N, K)
