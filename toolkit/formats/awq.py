"""AWQ GEMM checkpoint layout (``quant_method: "awq"``, ``version: "gemm"``), 4-bit only.

Per quantized linear ``<module>`` with K = in_features, N = out_features, g = group size, G = K/g groups:

| tensor              | dtype | shape    | content                                                         |
|---------------------|-------|----------|-----------------------------------------------------------------|
| ``<module>.qweight``| int32 | [K, N/8] | codes packed along the **output** dim, interleaved (AWQ_ORDER)   |
| ``<module>.qzeros`` | int32 | [G, N/8] | zeros, same interleave, stored as is (0..15, no −1)             |
| ``<module>.scales`` | fp16  | [G, N]   | per group and output channel                                    |
| ``<module>.bias``   | fp16  | [N]      | only when the linear has one                                    |

Nibble i of a word holds output column 8c + AWQ_ORDER[i] = 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] (docs/formats.md §1.1).
Dequant: ``W[n, k] = scales[k // g, n] · (q[k, n] − z[k // g, n])``. No ``g_idx``: groups are contiguous.
Sources: AutoAWQ ``awq/modules/linear/gemm.py`` (``WQLinear_GEMM.from_linear``) and ``awq/utils/packing_utils.py``
(the interleave), vLLM ``quantization/awq.py``, ``awq_marlin.py`` and ``auto_awq.py`` (load); docs/formats.md §1.1, §3.

Symmetric weights are written as zero-point AWQ with every zero equal to 8 (exact: the grid is the same), and the
config says ``zero_point: true``. ``zero_point: false`` would keep vLLM off the Marlin path (it pairs the AWQ type
``uint4`` with zero points only) and leave each loader to guess the implicit zero; explicit zeros load right everywhere.

Refused up front: other bit widths (AutoAWQ's ``WQLinear_GEMM`` and vLLM's AWQ GEMM kernels are 4-bit), per-channel
``group_size: -1`` (AutoAWQ and older vLLM ``awq.py`` compute ``K // group_size`` and fail; compressed-tensors'
``channel`` strategy serves it everywhere) and act-order with dynamic groups (no ``g_idx`` to carry the permutation).
"""

from __future__ import annotations

import sys

import torch

from toolkit.formats import vllm
from toolkit.formats.packing import pack as pack_codes
from toolkit.formats.packing import unpack as unpack_codes
from toolkit.formats.scheme import FormatError, Scheme, TritonKernel
from toolkit.quant.configs import ConfigError, WeightQuantConfig
from toolkit.quant.primitives import QuantizedWeight, default_g_idx

NAME = "awq"
SUFFIXES = ("qweight", "qzeros", "scales")
OPTIONAL_SUFFIXES = ()
CHECKPOINT = True  # a safetensors checkpoint directory with a quantization_config
BITS = 4
TRITON_KERNEL = TritonKernel("w4a16_awq", "awq_w4a16", {s: s for s in SUFFIXES})
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]


def check_supported(config: WeightQuantConfig) -> None:
    """Refuse settings that an AWQ GEMM checkpoint cannot carry, naming the way out."""
    if config.bits != BITS:
        raise ConfigError(f"the AWQ GEMM format stores 4-bit weights only, not {config.bits}; use --bits 4, or "
                          "--format compressed-tensors for 8-bit weights")
    if config.group_size == -1:
        raise ConfigError("AWQ checkpoints need a positive group size (AutoAWQ and older vLLM divide by it); "
                          "use --group-size 128, or --format compressed-tensors for per-channel scales")
    if config.act_order and not config.static_groups:
        raise ConfigError("AWQ checkpoints have no g_idx, so act-order with dynamic groups cannot be stored; "
                          "keep static groups (the default)")


def pack(qweight: QuantizedWeight, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The tensors of one linear in AWQ GEMM layout, by suffix.

    Scales are fp16 whatever the checkpoint ``dtype``: the engines' kernels for this layout read them so.
    """
    _check_bits(qweight.bits)
    N, K = qweight.codes.shape
    if N % 8:
        raise ValueError(f"AWQ packs 8 output columns per int32 word; out_features {N} is not a multiple of 8")
    if not torch.equal(qweight.g_idx.cpu(), default_g_idx(K, qweight.group_size)):
        raise ValueError("AWQ stores contiguous groups only (no g_idx); this weight has act-order groups")
    tensors = {
        "qweight": pack_codes(_interleave(qweight.codes.t()), BITS, dim=1),  # codes (K, N) → (K, N/8)
        "qzeros": pack_codes(_interleave(qweight.zero.t()), BITS, dim=1),  # (G, N) → (G, N/8)
        "scales": qweight.scale.t().to(torch.float16).contiguous(),  # (G, N)
    }
    if qweight.bias is not None:
        tensors["bias"] = qweight.bias.detach().to(torch.float16)
    return tensors


def unpack(tensors: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = False) -> QuantizedWeight:
    """Read one linear's AWQ tensors back into codes, scale, zero and g_idx (exact inverse of ``pack``)."""
    _check_bits(bits)
    codes = _deinterleave(unpack_codes(tensors["qweight"], BITS, dim=1).to(torch.uint8)).t()  # (K, N) → (N, K)
    zero = _deinterleave(unpack_codes(tensors["qzeros"], BITS, dim=1)).t()  # (G, N) → (N, G)
    return QuantizedWeight(
        codes=codes.to(torch.uint8).contiguous(),
        scale=tensors["scales"].float().t().contiguous(),
        zero=zero.to(torch.int32).contiguous(),
        g_idx=default_g_idx(codes.shape[1], group_size),
        bits=BITS,
        group_size=group_size,
        sym=sym,
        bias=tensors.get("bias"),
    )


def dequantize(tensors: dict[str, torch.Tensor], bits: int = BITS) -> torch.Tensor:
    """Float32 weight [N, K] straight from packed AWQ tensors; the group size is K / G."""
    _check_bits(bits)
    codes = _deinterleave(unpack_codes(tensors["qweight"], BITS, dim=1))  # (K, N)
    zeros = _deinterleave(unpack_codes(tensors["qzeros"], BITS, dim=1))  # (G, N)
    scales = tensors["scales"].float()  # (G, N)
    K, G = codes.shape[0], scales.shape[0]
    g = torch.arange(K, device=codes.device) // (K // G)  # group of every input row
    return (scales[g] * (codes - zeros[g]).float()).t()  # (K, N) → (N, K)


def quantization_config(config: WeightQuantConfig) -> dict:
    """The ``quantization_config`` block: AutoAWQ's keys (``to_transformers_dict``) in their canonical spellings.

    vLLM reads ``bits``, ``group_size``, ``zero_point``, ``modules_to_not_convert`` and ``lm_head``; transformers maps
    ``version`` to its ``format``. ``modules_to_not_convert`` is matched as a substring of module names by vLLM.
    """
    skipped = [name for name in config.skip if name != "lm_head"]  # lm_head is never quantized unless lm_head: true
    return {
        "quant_method": "awq",
        "bits": BITS,
        "group_size": config.group_size,
        "zero_point": True,  # also for symmetric weights: zeros of 8 are stored explicitly (module docstring)
        "version": "gemm",
        "modules_to_not_convert": skipped or None,
        "lm_head": False,
    }


def vllm_kernel(scheme: Scheme, quant: dict) -> tuple[str, str]:
    """(vLLM method → kernel, why) for an AWQ checkpoint on a CUDA GPU (vLLM 0.32, docs/formats.md §6)."""
    if scheme.bits != BITS:
        return "refused", f"vLLM's AWQ is 4-bit only; this has {scheme.bits}"
    if not scheme.zero_point:
        return "awq → AWQ GEMM", "zero_point false keeps AWQ off Marlin (it pairs uint4 with zero points)"
    if not vllm.marlin_group(scheme.group_size):
        return "awq → AWQ GEMM", vllm.not_marlin(scheme.group_size)
    return f"awq_marlin → {vllm.fast_kernel(scheme.group_size)}", \
        f"AWQ uint4 + zero points, g{scheme.group_size}, zero_point true"


def read_config(quant: dict) -> Scheme:
    """The numerics of an AWQ ``quantization_config`` (AutoAWQ's ``w_bit`` / ``q_group_size`` spellings too); any
    ``version`` but GEMM is refused. Always asymmetric on disk: zeros are stored when ``zero_point`` says so."""
    if str(quant.get("version", "gemm")).lower() != "gemm":
        raise FormatError(f"AWQ version {quant['version']!r} is not supported; only the GEMM layout is read")
    return Scheme(sys.modules[__name__], quant.get("bits", quant.get("w_bit")),
                  quant.get("group_size", quant.get("q_group_size")), sym=False,
                  zero_point=bool(quant.get("zero_point", False)), desc_act=False, required=SUFFIXES)


def _check_bits(bits: int) -> None:
    if bits != BITS:
        raise ValueError(f"AWQ GEMM holds 4-bit codes only, got {bits} bits")


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last (output) dim so that sequential packing lands column 8c + AWQ_ORDER[i] in nibble i."""
    *lead, N = x.shape
    return x.reshape(*lead, N // 8, 8)[..., list(AWQ_ORDER)].reshape(*lead, N)  # (..., N/8, 8) → (..., N)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_interleave``: nibble order back to column order along the last dim."""
    *lead, N = x.shape
    return x.reshape(*lead, N // 8, 8)[..., list(AWQ_REVERSE_ORDER)].reshape(*lead, N)  # (..., N/8, 8) → (..., N)
