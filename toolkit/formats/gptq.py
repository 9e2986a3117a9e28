"""GPTQ checkpoint layout (``quant_method: "gptq"``, ``checkpoint_format: "gptq"``, i.e. v1 zeros).

Per quantized linear ``<module>`` with K = in_features, N = out_features, b bits, G groups:

| tensor              | dtype | shape        | content                                                         |
|---------------------|-------|--------------|-----------------------------------------------------------------|
| ``<module>.qweight``| int32 | [K·b/32, N]  | codes packed along the input dim, dense little-endian (packing) |
| ``<module>.qzeros`` | int32 | [G, N·b/32]  | zero − 1 (the v1 convention) packed along the output dim        |
| ``<module>.scales`` | fp16  | [G, N]       | per group and output channel                                    |
| ``<module>.g_idx``  | int32 | [K]          | group of every input column, original column order              |
| ``<module>.bias``   | fp16  | [N]          | only when the linear has one                                    |

Dequant: ``W[n, k] = scales[g_idx[k], n] · (q[k, n] − (qzeros[g_idx[k], n] + 1))``. Sources: AutoGPTQ
``qlinear_cuda_old.py`` (pack), vLLM ``quantization/auto_gptq.py`` (load; ``gptq.py`` and ``gptq_marlin.py``
before 0.32); see docs/formats.md §2.

Current vLLM loads GPTQ only symmetric (4 or 8 bits for Marlin; 2/3/4/8 otherwise) and refuses ``desc_act`` with
groups; asymmetric v1 zeros also underflow when a true zero is 0. ``check_supported`` refuses those up front.
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
from toolkit.quant.primitives import QuantizedWeight

NAME = "gptq"
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
OPTIONAL_SUFFIXES = ()
CHECKPOINT = True  # a safetensors checkpoint directory with a quantization_config
SUPPORTED_BITS = (2, 3, 4, 8)
TRITON_KERNEL = TritonKernel("w4a16_gptq", "gptq_w4a16", {s: s for s in SUFFIXES})  # v1 zeros: all load.py reads


def check_supported(config: WeightQuantConfig) -> None:
    """Refuse settings that no serving engine would load from a GPTQ checkpoint, naming the rule and the way out."""
    if not config.sym:
        raise ConfigError(
            "asymmetric GPTQ checkpoints are refused: vLLM loads GPTQ only with sym=true, and v1 zero points "
            "underflow; use --sym (or, once available, --format awq / compressed-tensors for asymmetric weights)"
        )
    if config.bits not in SUPPORTED_BITS:
        raise ConfigError(
            f"the GPTQ format stores {', '.join(map(str, SUPPORTED_BITS))} bits, not {config.bits}; "
            "choose --bits 4 or 8"
        )
    if config.act_order and not config.static_groups and config.group_size != -1:
        raise ConfigError(
            "act-order with dynamic groups (desc_act: true with a group size) is refused by vLLM; "
            "keep static groups (the default) or use --group-size -1"
        )


def pack(qweight: QuantizedWeight, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The tensors of one linear in GPTQ layout, by suffix.

    Scales are fp16 whatever the checkpoint ``dtype``: the engines' kernels for this layout read them so.
    """
    bits = qweight.bits
    tensors = {
        "qweight": pack_codes(qweight.codes.t(), bits, dim=0),  # codes (K, N) → (K·b/32, N)
        "qzeros": pack_codes((qweight.zero - 1).t() & ((1 << bits) - 1), bits, dim=1),  # (G, N) → (G, N·b/32)
        "scales": qweight.scale.t().to(torch.float16).contiguous(),  # (G, N)
        "g_idx": qweight.g_idx.to(torch.int32),
    }
    if qweight.bias is not None:
        tensors["bias"] = qweight.bias.detach().to(torch.float16)
    return tensors


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = True) -> QuantizedWeight:
    """Read one linear's GPTQ tensors back into codes, scale, zero and g_idx (exact inverse of ``pack``)."""
    codes = unpack_codes(tensors["qweight"].t().contiguous(), bits, dim=1)  # (K·b/32, N) → (N, K·b/32) → (N, K)
    zero = (unpack_codes(tensors["qzeros"], bits, dim=1) + 1).t()  # v1 stores zero − 1; (G, N) → (N, G)
    return QuantizedWeight(
        codes=codes.to(torch.uint8).contiguous(),
        scale=tensors["scales"].float().t().contiguous(),
        zero=zero.to(torch.int32).contiguous(),
        g_idx=tensors["g_idx"].to(torch.int32),
        bits=bits,
        group_size=group_size,
        sym=sym,
        bias=tensors.get("bias"),
    )


def dequantize(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Float32 weight [N, K] straight from packed GPTQ tensors (the reference the kernels are tested against)."""
    codes = unpack_codes(tensors["qweight"], bits, dim=0)  # (K, N)
    zeros = unpack_codes(tensors["qzeros"], bits, dim=1) + 1  # (G, N)
    g = tensors["g_idx"].long()
    scales = tensors["scales"].float()
    return (scales[g] * (codes - zeros[g]).float()).t()  # (K, N) → (N, K)


def quantization_config(config: WeightQuantConfig) -> dict:
    """The ``quantization_config`` block of ``config.json`` (also written as ``quantize_config.json``)."""
    return {
        "quant_method": "gptq",
        "bits": config.bits,
        "group_size": config.group_size,
        # Static groups keep g_idx trivial, so the checkpoint is served as if not act-ordered.
        "desc_act": config.act_order and not config.static_groups,
        "sym": config.sym,
        "static_groups": config.act_order and config.static_groups,
        "true_sequential": bool(getattr(config, "true_sequential", True)),
        "damp_percent": float(getattr(config, "damp", 0.01)),
        "lm_head": False,
        "checkpoint_format": "gptq",
        "format": "gptq",
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"compound:{config.method}"]},
        # modules left in float besides lm_head (MoE routers): GPTQModel's negative rules, which vLLM also reads
        **({"dynamic": {f"-:(.*\\.)?{re.escape(name)}$": {} for name in skipped}}
           if (skipped := [n for n in config.skip if n != "lm_head"]) else {}),
    }


def vllm_kernel(scheme: Scheme, quant: dict) -> tuple[str, str]:
    """(vLLM method → kernel, why) for a GPTQ checkpoint on a CUDA GPU (vLLM 0.32, docs/formats.md §6); ``quant`` is
    the raw config, whose missing keys vLLM refuses."""
    bits, group_size = scheme.bits, scheme.group_size
    missing = [k for k in ("bits", "group_size", "sym", "desc_act") if k not in quant]
    if missing:
        return "refused", (f"keys {missing} missing: vLLM 0.32 requires them (older releases fall back to the "
                           "fp16-only ExLlama path, docs/formats.md §6)")
    if not scheme.sym:
        return "refused", "vLLM 0.32 loads GPTQ only symmetric ('Unsupported quantization config: sym=False')"
    if bits not in (4, 8):
        return "refused", f"vLLM 0.32 GPTQ type map is 4- and 8-bit symmetric; this has {bits}"
    if scheme.desc_act and group_size != -1:
        return "refused", "desc_act with groups is no longer supported; re-quantize with static groups"
    if not vllm.marlin_group(group_size):
        return "gptq_marlin → ExLlama/Triton fallback", vllm.not_marlin(group_size)
    return f"gptq_marlin → {vllm.fast_kernel(group_size)}", \
        f"GPTQ {'uint4b8' if bits == 4 else 'uint8b128'} (sym {bits}-bit), g{group_size}, every key present"


def read_config(quant: dict) -> Scheme:
    """The numerics of a GPTQ ``quantization_config``; v2 zeros (``checkpoint_format`` other than gptq) are refused.

    Missing keys read as None (bits, group_size) or False (sym, desc_act): vLLM requires them, and the serving preview
    reports them missing.
    """
    if quant.get("checkpoint_format", "gptq") != "gptq":
        raise FormatError(f"GPTQ checkpoint_format {quant['checkpoint_format']!r} is not supported; "
                          "only v1 zeros (checkpoint_format 'gptq') are read")
    sym = bool(quant.get("sym", False))
    return Scheme(sys.modules[__name__], quant.get("bits"), quant.get("group_size"), sym, zero_point=not sym,
                  desc_act=bool(quant.get("desc_act", False)), required=SUFFIXES)
