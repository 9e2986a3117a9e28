"""The static KV cache of the decoder: preallocated once, written in place, compacted after tree verification.

Tensors (batch is always 1; ``S`` below is ``max_len``, the cache's capacity in tokens):

| name                 | dtype                    | shape                              | holds                   |
|----------------------|--------------------------|------------------------------------|-------------------------|
| `k`, `v`             | model dtype, or int8     | [layers, 1, kv_heads, S, head_dim] | keys after RoPE, values |
| `k_scale`, `v_scale` | float32 (int8 only)      | [layers, 1, kv_heads, S, 1]        | scale per token, head   |

INT8 is symmetric: ``x ≈ q · scale`` with ``q`` in [-127, 127]. Scales are either computed on the fly per token and
head (``scale = absmax(x over head_dim) / 127``: no calibration, and an outlier token costs only itself), or given
per layer (``kv_scales[layer] = (k_scale, v_scale)``, the static scales a serving engine such as vLLM loads as
``k_scale`` / ``v_scale``); both are stored per slot so reading is one path.

Slot ``i`` of the cache holds the token at position ``i``: a verified tree is compacted (``keep``) so that the accepted
path lies contiguous right after the prefix, and rejected nodes are overwritten by the next forward.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
# ``compound decode --kv-cache-dtype``: None stores the model dtype; int8 scales each token and head as it is written,
# int8-static uses the static scales a checkpoint calibrated (``quantize --kv-cache int8``)
CACHE_DTYPES = {"float": None, "int8": torch.int8, "int8-static": torch.int8}


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 of ``x`` [..., head_dim]: (q int8 [..., head_dim], scale float32 [..., 1]).

    ``scale`` None: absmax over the last dim per row (per token and head). A float or tensor: used as given, broadcast.
    """
    x = x.float()
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / INT8_MAX
    else:
        scale = torch.as_tensor(scale, dtype=torch.float32).expand(*x.shape[:-1], 1)
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q · scale`` in ``dtype``."""
    return (q.float() * scale).to(dtype)


class KVCache:
    """Keys and values of every layer, float or INT8 (see the module docstring for the tensors)."""

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, kv_scales: torch.Tensor | None = None, device=None):
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (torch.int8, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"kv_dtype must be a float dtype or torch.int8, got {kv_dtype}")
        if kv_scales is not None:
            if kv_dtype != torch.int8:
                raise ValueError("kv_scales only apply to an INT8 cache: pass kv_dtype=torch.int8 or drop kv_scales")
            kv_scales = torch.as_tensor(kv_scales, dtype=torch.float32)
            if kv_scales.shape != (layers, 2):
                raise ValueError(f"kv_scales must be [layers, 2] = [{layers}, 2] (k_scale, v_scale per layer), "
                                 f"got {list(kv_scales.shape)}")
        self.dtype, self.kv_dtype, self.kv_scales, self.max_len = dtype, kv_dtype, kv_scales, max_len
        shape = (layers, 1, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.v = torch.zeros(shape, dtype=kv_dtype, device=device)
        if kv_dtype == torch.int8:
            self.k_scale = torch.zeros(*shape[:-1], 1, device=device)
            self.v_scale = torch.zeros(*shape[:-1], 1, device=device)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype == torch.int8

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [1, kv_heads, T, head_dim] at slots [start, start + T) of ``layer``."""
        end = start + k.shape[2]
        if not self.quantized:
            self.k[layer, :, :, start:end] = k
            self.v[layer, :, :, start:end] = v
            return
        k_given, v_given = (None, None) if self.kv_scales is None else self.kv_scales[layer].tolist()
        self.k[layer, :, :, start:end], self.k_scale[layer, :, :, start:end] = quantize_int8(k, k_given)
        self.v[layer, :, :, start:end], self.v_scale[layer, :, :, start:end] = quantize_int8(v, v_given)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, end) of ``layer``, [1, kv_heads, end, head_dim] in the model dtype."""
        if not self.quantized:
            return self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        return (dequantize_int8(self.k[layer, :, :, :end], self.k_scale[layer, :, :, :end], self.dtype),
                dequantize_int8(self.v[layer, :, :, :end], self.v_scale[layer, :, :, :end], self.dtype))

    def keep(self, start: int, slots: torch.Tensor | list[int]) -> None:
        """Compact after verification: move slots ``start + slots[i]`` to ``start + i`` in every layer.

        ``slots`` are offsets from ``start`` in increasing order (the root at 0, then the accepted nodes), so the
        accepted path ends up contiguous; everything after it is stale and will be overwritten.
        """
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.k.device)
        src = start + slots
        end = start + len(slots)
        buffers = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        for t in buffers:
            t[:, :, :, start:end] = t.index_select(3, src)  # index_select copies, so overlapping moves are safe
