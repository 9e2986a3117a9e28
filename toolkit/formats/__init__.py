"""On-disk checkpoint formats: one module per layout, with its tensor table in the docstring, and their registry.

Each format module declares ``NAME``, ``SUFFIXES`` (the tensors of every quantized linear), ``OPTIONAL_SUFFIXES``,
``check_supported(config)``, ``pack`` / ``unpack`` / ``dequantize``, ``quantization_config(config)`` (what it writes)
and ``read_config(quant)`` (what it reads back, a ``Scheme``).
"""

from __future__ import annotations

from types import ModuleType

from toolkit.formats import awq, compressed_tensors, gptq
from toolkit.formats.scheme import FormatError, Scheme
from toolkit.quant.configs import WeightQuantConfig

FORMATS: dict[str, ModuleType] = {module.NAME: module for module in (gptq, awq, compressed_tensors)}
PACKED_SUFFIXES = frozenset(s for module in FORMATS.values() for s in module.SUFFIXES + module.OPTIONAL_SUFFIXES)


def choose_format(config: WeightQuantConfig) -> str:
    """The format ``auto`` stands for (``format_choice`` says why)."""
    return format_choice(config)[0]


def format_choice(config: WeightQuantConfig) -> tuple[str, str]:
    """(the format ``auto`` stands for, why): GPTQ for symmetric weights, AWQ for asymmetric 4-bit groups (the
    layouts with the widest engine support), compressed-tensors for what neither stores."""
    if config.sym and config.bits in gptq.SUPPORTED_BITS:
        return gptq.NAME, f"auto: symmetric {config.bits}-bit weights are written in the GPTQ layout"
    if not config.sym and config.bits == awq.BITS and config.group_size != -1:
        order = " with static groups (no g_idx needed)" if config.act_order else ""
        return awq.NAME, (f"auto: asymmetric 4-bit{' act-order' if config.act_order else ''} weights{order} are "
                          "written in the AWQ layout, since engines load GPTQ checkpoints only symmetric")
    return compressed_tensors.NAME, (f"auto: {'symmetric' if config.sym else 'asymmetric'} {config.bits}-bit "
                                     f"{'per-channel ' if config.group_size == -1 else ''}weights are stored by "
                                     "neither the GPTQ nor the AWQ layout")


def read_quantization_config(quant: dict) -> Scheme:
    """The format and numerics of a checkpoint's ``quantization_config``; ``FormatError`` for what no format reads."""
    method = quant.get("quant_method")
    if method not in FORMATS:
        raise FormatError(f"quant_method {method!r} is not supported; expected one of {', '.join(FORMATS)}")
    return FORMATS[method].read_config(quant)
