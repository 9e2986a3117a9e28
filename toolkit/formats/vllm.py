"""What vLLM's mixed-precision kernel chooser does with a layer of a given group size (vLLM 0.32), shared by the
formats' ``vllm_kernel`` predictions (docs/formats.md §6)."""

from __future__ import annotations

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # vLLM quantization/utils/marlin_utils.py: MARLIN_SUPPORTED_GROUP_SIZES
MACHETE_GROUP_SIZES = (-1, 64, 128)  # vLLM machete_utils, fp16/bf16 activations


def marlin_group(group_size: int) -> bool:
    """Whether vLLM's Marlin kernels take this group size."""
    return group_size in MARLIN_GROUP_SIZES


def not_marlin(group_size: int) -> str:
    """Why a layer of ``group_size`` misses Marlin."""
    return f"group {group_size} is not a Marlin group size {MARLIN_GROUP_SIZES}"


def fast_kernel(group_size: int) -> str:
    """The mixed-precision kernel vLLM's chooser lands on for a Marlin-compatible layer."""
    if group_size in MACHETE_GROUP_SIZES:
        return "Marlin (Machete on Hopper, sm90)"
    return "Marlin (Machete needs g ∈ {-1, 64, 128})"
