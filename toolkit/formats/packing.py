"""Dense little-endian bit packing of integer codes into int32 words.

Code ``i`` along the packed dimension occupies bits ``[i·b, (i+1)·b)`` of the concatenated word stream, bit 0 of
word 0 first. For b = 2, 4, 8 this is the familiar "code j of a word sits at bits [j·b, (j+1)·b)" layout; for
b = 3 it is AutoGPTQ's layout (32 codes in 3 words, codes straddling word boundaries).
"""

from __future__ import annotations

import torch


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``codes`` (values < 2^bits) along ``dim`` into int32 words; that dim shrinks by 32/bits."""
    moved = codes.movedim(dim, 0)  # (L, ...)
    length = moved.shape[0]
    if (length * bits) % 32:
        raise ValueError(f"cannot pack {length} codes of {bits} bits into whole 32-bit words")
    if 32 % bits == 0:
        return _pack_aligned(moved, bits).movedim(0, dim).contiguous()
    moved = moved.to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = (moved.unsqueeze(1) >> shifts.view(1, bits, *[1] * (moved.dim() - 1))) & 1  # (L, bits, ...)
    stream = stream.reshape(length * bits // 32, 32, *moved.shape[1:])  # (words, 32, ...)
    weights = (torch.ones(1, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)).view(1, 32, *[1] * (moved.dim() - 1))
    words = (stream * weights).sum(dim=1)  # (words, ...) in [0, 2^32)
    return _to_int32(words).movedim(0, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack``: int32 words along ``dim`` → codes (int32) with that dim grown by 32/bits."""
    if 32 % bits == 0:
        return _unpack_aligned(words, bits, dim)
    moved = words.movedim(dim, 0).to(torch.int64) & 0xFFFFFFFF  # (W, ...) unsigned
    count = moved.shape[0]
    bit_positions = torch.arange(32, dtype=torch.int64).view(1, 32, *[1] * (moved.dim() - 1))
    stream = ((moved.unsqueeze(1) >> bit_positions) & 1).reshape(count * 32 // bits, bits, *moved.shape[1:])
    weights = (torch.ones(1, dtype=torch.int64) << torch.arange(bits, dtype=torch.int64)).view(1, bits, *[1] * (moved.dim() - 1))
    codes = (stream * weights).sum(dim=1).to(torch.int32)  # (L, ...)
    return codes.movedim(0, dim).contiguous()


def _unpack_aligned(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Fast path when codes never straddle words (b = 2, 4, 8): one shift and mask per code slot."""
    per_word = 32 // bits
    moved = words.movedim(dim, -1)  # (..., W)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    codes = moved.unsqueeze(-1) >> shifts  # (..., W, per_word), contiguous
    codes &= (1 << bits) - 1  # masks the sign extension
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return codes.movedim(-1, dim).contiguous()  # no copy when dim is the last


def _pack_aligned(moved: torch.Tensor, bits: int) -> torch.Tensor:
    """Fast path of ``pack`` for b = 2, 4, 8: codes (L, ...) → words (L·b/32, ...) int32, one code slot at a time
    (the temporaries are word-sized: a linear's int64 codes at once would be 8 bytes per weight)."""
    per_word = 32 // bits
    slots = moved.reshape(moved.shape[0] // per_word, per_word, *moved.shape[1:])  # (words, per_word, ...)
    words = torch.zeros(slots.shape[0], *slots.shape[2:], dtype=torch.int64, device=moved.device)
    for slot in range(per_word):
        words |= slots[:, slot].to(torch.int64) << (slot * bits)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) → the int32 with the same bits (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
