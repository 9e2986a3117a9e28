"""On-disk formats: one module per layout, with its tensor table in the docstring, and their registry.

Every format module declares ``NAME``, ``CHECKPOINT`` (True: a safetensors checkpoint directory with a
``quantization_config``; False: one file written from a checkpoint's codes, GGUF), ``TRITON_KERNEL`` (the
``TritonKernel`` that runs it in ``QuantLinear``, None where compound runs none) and ``vllm_kernel(scheme, quant)``
(the vLLM method and kernel a checkpoint gets, and why). A checkpoint layout also declares ``SUFFIXES`` (the tensors
of every quantized linear), ``OPTIONAL_SUFFIXES``, ``check_supported(config)``, ``pack`` / ``unpack`` /
``dequantize``, ``quantization_config(config)`` (what it writes) and ``read_config(quant)`` (what it reads back, a
``Scheme``); GGUF's grid check is ``gguf.block_type``. The byte layouts are in docs/formats.md.
"""

from __future__ import annotations

from types import ModuleType

from toolkit.formats import awq, compressed_tensors, gguf, gptq
from toolkit.formats.scheme import FormatError, Scheme
from toolkit.quant.configs import ConfigError, WeightQuantConfig

FORMATS: dict[str, ModuleType] = {module.NAME: module for module in (gptq, awq, compressed_tensors, gguf)}
LAYOUTS = {name: module for name, module in FORMATS.items() if module.CHECKPOINT}  # checkpoint directory layouts
PACKED_SUFFIXES = frozenset(s for module in LAYOUTS.values() for s in module.SUFFIXES + module.OPTIONAL_SUFFIXES)
AUTO = "auto"  # the --format that lets ``resolve`` choose the layout


def resolve(name: str, config: WeightQuantConfig) -> tuple[ModuleType, str]:
    """The checkpoint layout a quantize run writes for ``--format name`` (``auto``: chosen for ``config``'s
    numerics) and why; ``ConfigError`` for a name that is no layout. Whether the layout stores ``config`` is its own
    ``check_supported``."""
    if name == AUTO:
        layout, why = _choose(config)
    elif name in LAYOUTS:
        layout, why = LAYOUTS[name], f"--format {name}"
    else:
        raise ConfigError(f"unknown format {name!r}; choose {AUTO} or one of {', '.join(LAYOUTS)}")
    return layout, why


def _choose(config: WeightQuantConfig) -> tuple[ModuleType, str]:
    """(the layout ``auto`` stands for, why): GPTQ for symmetric weights, AWQ for asymmetric 4-bit groups (the
    layouts with the widest engine support), compressed-tensors for what neither stores; ``ConfigError`` naming
    ``--sym`` for asymmetric weights of a width only the GPTQ layout stores."""
    if config.sym and config.bits in gptq.SUPPORTED_BITS:
        return gptq, f"auto: symmetric {config.bits}-bit weights are written in the GPTQ layout"
    if not config.sym and config.bits == awq.BITS and config.group_size != -1:
        order = " with static groups (no g_idx needed)" if config.act_order else ""
        return awq, (f"auto: asymmetric 4-bit{' act-order' if config.act_order else ''} weights{order} are "
                     "written in the AWQ layout, since engines load GPTQ checkpoints only symmetric")
    if config.bits not in compressed_tensors.SUPPORTED_BITS and config.bits in gptq.SUPPORTED_BITS:
        raise ConfigError(f"no layout stores asymmetric {config.bits}-bit weights (AWQ stores 4 bits, "
                          f"compressed-tensors {' or '.join(map(str, compressed_tensors.SUPPORTED_BITS))}); pass --sym "
                          f"(the GPTQ layout stores {', '.join(map(str, gptq.SUPPORTED_BITS))} bits)")
    return compressed_tensors, (f"auto: {'symmetric' if config.sym else 'asymmetric'} {config.bits}-bit "
                                f"{'per-channel ' if config.group_size == -1 else ''}weights are stored by "
                                "neither the GPTQ nor the AWQ layout")


def read_quantization_config(quant: dict) -> Scheme:
    """The format and numerics of a checkpoint's ``quantization_config``; ``FormatError`` for what no format reads."""
    method = quant.get("quant_method")
    if method not in LAYOUTS:
        raise FormatError(f"quant_method {method!r} is not supported; expected one of {', '.join(LAYOUTS)}")
    return LAYOUTS[method].read_config(quant)
