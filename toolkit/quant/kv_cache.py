"""Static KV-cache scales: one number per layer (or per KV head) with which keys and values are stored in 8 bits.

Objective: no cached key or value saturates. ``scale = amax / qmax``, with ``amax`` the largest |x| of the keys
(after RoPE, i.e. what is cached) or of the values over the calibration batch, and ``qmax`` the largest magnitude of
the 8-bit type: 448 for FP8 E4M3, 127 for symmetric INT8. Dequant ``x ≈ q · scale`` (a multiplier, as vLLM and
compressed-tensors define ``k_scale``); an all-zero tensor gets scale 1 (any scale reproduces it).

Written per decoder layer ``i`` (docs/formats.md §7; names as llm-compressor writes them, remapped by vLLM's
``maybe_remap_kv_scale_name`` / ``get_cache_scale_mapper`` to ``self_attn.attn.k_scale``):

| tensor                               | dtype       | shape                               | content          |
|--------------------------------------|-------------|-------------------------------------|------------------|
| ``model.layers.{i}.self_attn.k_scale`` | model dtype | [1] per tensor, [n_kv, 1, 1] per head | amax(K) / qmax   |
| ``model.layers.{i}.self_attn.v_scale`` | model dtype | same                                | amax(V) / qmax   |

[1] is what vLLM's scalar ``KVCacheScaleParameter`` and compressed-tensors' tensor strategy load; [n_kv, 1, 1] is
compressed-tensors' ``attn_head`` shape (vLLM flattens it, and on backends without per-head support uses the max).

Who reads them (vLLM 0.32):
  * compressed-tensors: ``CompressedTensorsKVCacheMethod`` loads them on every attention layer; the config declares
    them with ``kv_cache_scheme`` (``kv_cache_scheme()`` below; FP8 only, vLLM refuses integer KV schemes), and a
    declared scheme makes vLLM's default ``--kv-cache-dtype auto`` an fp8 cache (pass ``float16`` / ``bfloat16``
    for a float one). On CPU the fp8 cache needs AVX-512 or AMX.
  * GPTQ / AWQ: their quantization configs attach no KV-cache method to attention, so vLLM drops the scales as
    "unexpected" and ``--kv-cache-dtype fp8`` runs with scale 1.0 (or ``--calculate-kv-scales``). The tensors are
    still written, for compound's own runtime and decode loop, and the manifest records their type.
  * compound: ``load_quantized`` attaches them as buffers of ``self_attn``; ``decode_scales`` turns INT8 ones into
    the decode loop's ``kv_scales`` [layers, 2], which ``compound decode --kv-cache-dtype int8`` runs with.
"""

from __future__ import annotations

import torch
from torch import nn

QMAX = {"fp8": 448.0, "int8": 127.0}  # largest magnitude of FP8 E4M3 / symmetric INT8
STRATEGIES = ("tensor", "attn_head")  # compressed-tensors' names: one scale per layer, one per KV head
SCALE_NAMES = ("k_scale", "v_scale")


def absmax(x: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """Largest |x| of keys or values x [B, n_kv, T, head_dim]: a scalar, or one per KV head [n_kv]."""
    x = x.detach().float().abs()
    return x.transpose(0, 1).reshape(x.shape[1], -1).amax(dim=1) if per_head else x.amax()  # (n_kv, B·T·hd)


def scale_from_absmax(amax: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """``amax / qmax`` of ``kv_dtype`` (fp8 E4M3: 448, int8: 127), float32; 1 where amax is 0."""
    amax = amax.float()
    return torch.where(amax > 0, amax / QMAX[kv_dtype], torch.ones_like(amax))


class KVAbsMax:
    """Stands in for the transformers KV cache while a decoder layer runs on calibration data: the attention hands
    ``update`` the keys (after RoPE) and values it would cache, [B, n_kv, T, head_dim]; their running absmax is kept
    and they are returned unchanged, so the layer computes exactly what it computes without a cache."""

    def __init__(self, per_head: bool = False):
        self.per_head = per_head
        self.k_amax: torch.Tensor | None = None
        self.v_amax: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = absmax(key_states, self.per_head), absmax(value_states, self.per_head)
        self.k_amax = k if self.k_amax is None else torch.maximum(self.k_amax, k)
        self.v_amax = v if self.v_amax is None else torch.maximum(self.v_amax, v)
        return key_states, value_states


def checkpoint_tensors(
    amax: list[tuple[torch.Tensor, torch.Tensor]], kv_dtype: str, prefix: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``{prefix}.{i}.self_attn.k_scale`` / ``.v_scale`` for (K amax, V amax) of every layer i, shaped [1] per
    tensor or [n_kv, 1, 1] per head, in ``dtype``."""
    tensors = {}
    for i, pair in enumerate(amax):
        for name, a in zip(SCALE_NAMES, pair):
            scale = scale_from_absmax(a, kv_dtype)
            shape = (1,) if scale.dim() == 0 else (scale.numel(), 1, 1)
            tensors[f"{prefix}.{i}.self_attn.{name}"] = scale.reshape(shape).to(dtype)
    return tensors


def kv_cache_scheme(kv_dtype: str, strategy: str = "tensor") -> dict:
    """compressed-tensors' ``kv_cache_scheme`` for FP8 scales (the only KV scheme vLLM accepts: 8-bit float,
    symmetric, static); only fields of ``QuantizationArgs``, which forbids unknown keys."""
    if kv_dtype != "fp8":
        raise ValueError(f"compressed-tensors KV-cache schemes served by vLLM are FP8 only, not {kv_dtype}")
    if strategy not in STRATEGIES:
        raise ValueError(f"KV-cache strategy must be one of {STRATEGIES}, got {strategy!r}")
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def decode_scales(model: nn.Module, layers_path: str = "model.layers") -> torch.Tensor | None:
    """The decode loop's ``kv_scales`` [layers, 2] = (k_scale, v_scale) per layer, float32, from the buffers that
    ``load_quantized`` attaches (per-head scales reduce to their max); None when the checkpoint has none.

    Only INT8 scales (amax / 127) fit the decode loop's INT8 cache; FP8 ones (amax / 448) would saturate it."""
    rows = []
    for layer in model.get_submodule(layers_path):
        attn = layer.self_attn
        if not all(hasattr(attn, name) for name in SCALE_NAMES):
            return None
        rows.append(torch.stack([getattr(attn, name).float().max() for name in SCALE_NAMES]))
    return torch.stack(rows)  # (layers, 2)


def int8_decode_scales(model: nn.Module, manifest: dict) -> torch.Tensor | None:
    """``decode_scales`` of a checkpoint whose manifest records INT8 KV-cache scales (``quantize --kv-cache int8``);
    None for any other (no scales, or FP8 ones), whose INT8 cache then scales each token and head as it is written."""
    return decode_scales(model) if (manifest.get("kv_cache") or {}).get("dtype") == "int8" else None
