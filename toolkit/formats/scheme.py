"""What a checkpoint's ``quantization_config`` says about its weights, read back by the format that wrote it."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


class FormatError(ValueError):
    """A ``quantization_config`` variant that compound cannot read: its tensors would decode wrong."""


@dataclass(frozen=True)
class Scheme:
    """The weight numerics of a checkpoint, as its format module (``toolkit.formats.gptq`` …) reads them.

    bits: code width. group_size: input columns per scale (-1: per output channel). sym: symmetric grid.
    zero_point: zero points are stored. desc_act: dynamic act-order (a permuted ``g_idx``; static groups read as off).
    required: the tensor suffixes every quantized linear must have.
    """

    format: ModuleType
    bits: int
    group_size: int
    sym: bool
    zero_point: bool
    desc_act: bool
    required: tuple[str, ...]


@dataclass(frozen=True)
class TritonKernel:
    """The W4A16 Triton kernel that multiplies by one layout's packed tensors: ``function`` of module
    ``toolkit.kernels.<module>``, called as ``function(x, group_size=g, **{argument: tensor})`` with each argument
    taken from the layout's tensor ``arguments[argument]`` (None where a linear has no such tensor). Named, not
    imported: declaring it imports no Triton."""

    module: str
    function: str
    arguments: dict[str, str]  # the kernel's keyword → the layout's tensor suffix
