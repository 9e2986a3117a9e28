"""compressed-tensors ``pack-quantized`` layout (``quant_method: "compressed-tensors"``): W4A16 and W8A16.

Per quantized linear ``<module>`` with K = in_features, N = out_features, b = 4 or 8 bits, G groups:

| tensor                         | dtype       | shape             | content                                          |
|--------------------------------|-------------|-------------------|--------------------------------------------------|
| ``<module>.weight_packed``     | int32       | [N, ceil(K·b/32)] | code q + 2^(b−1), packed along the input dim     |
| ``<module>.weight_scale``      | model dtype | [N, G]            | per output channel and group (channel: G = 1)    |
| ``<module>.weight_zero_point`` | int32       | [ceil(N·b/32), G] | zp + 2^(b−1), along the output dim; asym only    |
| ``<module>.weight_shape``      | int64       | [2]               | [N, K]                                           |
| ``<module>.bias``              | model dtype | [N]               | only when the linear has one                     |

Packing is sequential little-endian (code i of the packed dim at bits [i·b, (i+1)·b) of the word stream), padded
with zero codes to whole words. Dequant: ``W = (q − zp) · scale`` with the signed values, which equals our
``scale · (code − zero)`` with the unsigned ones: a compound code is already q + 2^(b−1), a compound zero zp + 2^(b−1),
and the symmetric zero 2^(b−1) is zp = 0. Hence, for symmetric 4-bit weights, ``weight_packed == qweight.T`` and
``weight_scale == scales.T`` of the GPTQ checkpoint of the same codes (docs/formats.md §4). Sources: compressed-tensors
``compressors/pack_quantized/{base,helpers}.py`` (``pack_to_int32``, ``unpack_from_int32``),
``quantization/quant_args.py``; vLLM ``compressed_tensors/schemes/compressed_tensors_wNa16.py`` (load).

``weight_g_idx`` (``actorder: "group"``) is read, never written: compressed-tensors 0.20 and current vLLM refuse
group act-order, so act-order is written only with static groups (``actorder: "weight"``, trivial g_idx).
"""

from __future__ import annotations

import re
import sys

import torch

from toolkit.formats import vllm
from toolkit.formats.packing import pack as pack_codes
from toolkit.formats.packing import unpack as unpack_codes
from toolkit.formats.scheme import FormatError, Scheme, TritonKernel
from toolkit.quant.configs import ConfigError, WeightQuantConfig
from toolkit.quant.primitives import QuantizedWeight, default_g_idx

NAME = "compressed-tensors"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")  # always present
OPTIONAL_SUFFIXES = ("weight_zero_point", "weight_g_idx")
CHECKPOINT = True  # a safetensors checkpoint directory with a quantization_config
SUPPORTED_BITS = (4, 8)
TRITON_KERNEL = TritonKernel("w4a16_ct", "ct_w4a16", {"weight_packed": "weight_packed", "weight_scale": "weight_scale",
                                                      "weight_zero_point": "weight_zero_point", "g_idx": "weight_g_idx"})
# The release whose strict (extra="forbid") parser the tests check this key set against; it parses under 0.17 too.
COMPRESSED_TENSORS_VERSION = "0.20.1"


def check_supported(config: WeightQuantConfig) -> None:
    """Refuse settings that vLLM's ``CompressedTensorsWNA16`` would not load, naming the way out."""
    if config.bits not in SUPPORTED_BITS:
        raise ConfigError(f"pack-quantized stores {' or '.join(map(str, SUPPORTED_BITS))}-bit weights, not "
                          f"{config.bits}; choose --bits 4 or 8")
    if config.act_order and not config.static_groups and config.group_size != -1:
        raise ConfigError("act-order with dynamic groups (actorder: group) was removed from compressed-tensors and "
                          "vLLM; keep static groups (the default) or use --group-size -1")


def pack(qweight: QuantizedWeight, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The tensors of one linear in pack-quantized layout, by suffix; scales (and bias) in ``dtype``, the model's."""
    bits = qweight.bits
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack-quantized holds 4- or 8-bit codes, got {bits} bits")
    N, K = qweight.codes.shape
    if not torch.equal(qweight.g_idx.cpu(), default_g_idx(K, qweight.group_size)):
        raise ValueError("act-order groups (a permuted g_idx) are refused: compressed-tensors no longer reads "
                         "actorder 'group'; quantize with static groups")
    tensors = {
        "weight_packed": _pack_padded(qweight.codes, bits, dim=1),  # (N, K) → (N, ceil(K·b/32))
        "weight_scale": qweight.scale.to(dtype).contiguous(),  # (N, G)
        "weight_shape": torch.tensor([N, K], dtype=torch.int64),
    }
    if not qweight.sym:
        tensors["weight_zero_point"] = _pack_padded(qweight.zero, bits, dim=0)  # (N, G) → (ceil(N·b/32), G)
    if qweight.bias is not None:
        tensors["bias"] = qweight.bias.detach().to(dtype)
    return tensors


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = True) -> QuantizedWeight:
    """Read one linear's pack-quantized tensors back into codes, scale, zero and g_idx (exact inverse of ``pack``)."""
    codes, zero, g_idx = _integers(tensors, bits)
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scale=tensors["weight_scale"].float().contiguous(),
        zero=zero.to(torch.int32),
        g_idx=default_g_idx(codes.shape[1], group_size) if g_idx is None else g_idx.to(torch.int32),
        bits=bits,
        group_size=group_size,
        sym=sym,
        bias=tensors.get("bias"),
    )


def dequantize(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Float32 weight [N, K] straight from packed tensors; without ``weight_g_idx`` the group size is K / G."""
    codes, zero, g_idx = _integers(tensors, bits)
    scale = tensors["weight_scale"].float()  # (N, G)
    K, G = codes.shape[1], scale.shape[1]
    g = torch.arange(K, device=codes.device) // (K // G) if g_idx is None else g_idx.long()
    return scale[:, g] * (codes - zero[:, g]).float()  # (N, K)


def quantization_config(config: WeightQuantConfig) -> dict:
    """The ``quantization_config`` block, with the minimal key set every strict parser accepts.

    ``QuantizationArgs`` and ``QuantizationScheme`` forbid unknown keys (compressed-tensors ≥ 0.11), and fields added
    later (``scale_dtype``, ``zp_dtype``, the scheme's own ``format``) break older parsers, so only long-standing
    fields are written; everything omitted has the default that describes these tensors.
    """
    weights = {
        "num_bits": config.bits,
        "type": "int",
        "symmetric": config.sym,
        "strategy": "channel" if config.group_size == -1 else "group",
        "group_size": None if config.group_size == -1 else config.group_size,
        "dynamic": False,
        # "weight" is the canonical name of static-group act-order in every release ("static" is a later alias).
        "actorder": "weight" if config.act_order else None,
        "observer": "mse" if getattr(config, "mse_clip", False) else "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        # lm_head is never quantized by compound; other skipped modules as anchored patterns of the same suffix rule
        "ignore": ["lm_head"] + [f"re:(.*\\.)?{re.escape(name)}$" for name in config.skip if name != "lm_head"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def vllm_kernel(scheme: Scheme, quant: dict) -> tuple[str, str]:
    """(vLLM method → kernel, why) for a compressed-tensors checkpoint on a CUDA GPU (vLLM 0.32, docs/formats.md
    §6)."""
    bits, group_size = scheme.bits, scheme.group_size
    if not vllm.marlin_group(group_size):
        return "compressed-tensors WNA16 → Triton/ExLlama fallback", vllm.not_marlin(group_size)
    kind = f"uint{bits}b{1 << (bits - 1)}" if scheme.sym else f"uint{bits} + zero points"
    return f"compressed-tensors WNA16 → {vllm.fast_kernel(group_size)}", f"pack-quantized {kind}, g{group_size}"


def read_config(quant: dict) -> Scheme:
    """The numerics of a compressed-tensors ``quantization_config``: one ``config_groups`` scheme in the
    ``pack-quantized`` format, or refused. Asymmetric weights must carry ``weight_zero_point``."""
    groups = list(quant.get("config_groups", {}).values())
    if quant.get("format") != "pack-quantized" or len(groups) != 1:
        raise FormatError(f"only single-scheme pack-quantized compressed-tensors checkpoints are read "
                          f"(format {quant.get('format')!r}, {len(groups)} config groups)")
    weights = groups[0]["weights"]
    sym = bool(weights.get("symmetric", True))
    return Scheme(sys.modules[__name__], weights["num_bits"], weights.get("group_size") or -1, sym, zero_point=not sym,
                  desc_act=weights.get("actorder") == "group",
                  required=SUFFIXES + (() if sym else ("weight_zero_point",)))


def _integers(tensors: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unsigned codes [N, K], unsigned zeros [N, G] (2^(b−1) when symmetric) and g_idx [K] or None."""
    N, K = (int(v) for v in tensors["weight_shape"])
    G = tensors["weight_scale"].shape[1]
    codes = unpack_codes(tensors["weight_packed"], bits, dim=1)[:, :K]  # (N, words·32/b) → (N, K)
    if "weight_zero_point" in tensors:
        zero = unpack_codes(tensors["weight_zero_point"], bits, dim=0)[:N]  # (words·32/b, G) → (N, G)
    else:
        zero = torch.full((N, G), 1 << (bits - 1), dtype=torch.int32, device=codes.device)
    return codes.contiguous(), zero.contiguous(), tensors.get("weight_g_idx")


def _pack_padded(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``values`` along ``dim``, padding with zero codes to whole words (as ``pack_to_int32`` does)."""
    per_word = 32 // bits
    pad = -values.shape[dim] % per_word
    if pad:
        shape = list(values.shape)
        shape[dim] = pad
        values = torch.cat([values, values.new_zeros(shape)], dim=dim)
    return pack_codes(values, bits, dim=dim)
