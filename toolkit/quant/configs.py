"""Frozen, self-validating configs for each quantization method, and the registry that maps a method name to one.

A config names the numerics it produces and checks itself on construction, so a bad request fails before any
calibration runs. ``check_width`` checks it against a real model's linears.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)


class ConfigError(ValueError):
    """A quantization request that cannot be honoured; the message names the value and the fix."""


@dataclass(frozen=True)
class WeightQuantConfig:
    """Integer weight-only quantization shared by every method.

    bits: code width, 2..8. group_size: input columns per scale (-1: per output channel; 32/64/128).
    sym: symmetric grid (zero fixed at 2^(bits-1)). skip: module names or suffixes left in float (lm_head by default).
    act_order / static_groups: the column order the codes were chosen in, which every format must record (only
    GPTQ-based methods reorder: see ``GPTQConfig``).
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    skip: tuple[str, ...] = ("lm_head",)
    seed: int = 0
    act_order: bool = False
    static_groups: bool = True
    version: int = field(default=1, repr=False)

    method = "base"
    needs_activations = True

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"bits must be between 2 and 8, got {self.bits}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ConfigError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")

    def check_width(self, name: str, in_features: int) -> None:
        """Refuse a linear whose input width the group size does not divide."""
        if self.group_size != -1 and in_features % self.group_size:
            options = [g for g in SUPPORTED_GROUP_SIZES if g == -1 or in_features % g == 0]
            raise ConfigError(
                f"group_size {self.group_size} does not divide the input width of {name} "
                f"({in_features} % {self.group_size} = {in_features % self.group_size}); "
                f"try --group-size {' or '.join(str(g) for g in options)}"
            )

    def to_dict(self) -> dict:
        """Plain dict of every field plus the method name, for manifests and fingerprints."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["skip"] = list(self.skip)
        return {"method": self.method, **out}


@dataclass(frozen=True)
class RTNConfig(WeightQuantConfig):
    """Round-to-nearest on per-group min/max: no calibration data needed."""

    method = "rtn"
    needs_activations = False


@dataclass(frozen=True)
class GPTQConfig(WeightQuantConfig):
    """GPTQ (arXiv 2210.17323): column-by-column rounding with Hessian-based error compensation.

    damp: dampening added to the Hessian diagonal, relative to its mean (raised automatically when Cholesky fails).
    block_size: columns per lazy-update block. act_order: process columns by decreasing Hessian diagonal (on by
    default: with static groups it costs nothing at run time, and on SmolLM2-135M W4 g64 it is what lets GPTQ beat
    RTN at all; llm-compressor's default too). static_groups: with act_order and groups, fix the groups in original
    column order (vLLM refuses desc_act with groups otherwise). mse_clip: search each group's range for the lowest squared error instead of min/max.
    true_sequential: quantize q/k/v, then o, then gate/up, then down, each seeing the already-quantized ones.
    """

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True
    mse_clip: bool = False
    true_sequential: bool = True

    method = "gptq"

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.damp < 1:
            raise ConfigError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")


@dataclass(frozen=True)
class AWQConfig(WeightQuantConfig):
    """AWQ (arXiv 2306.00978): activation-aware per-channel scaling searched on the block output, then clipping.

    sym defaults to False (AWQ's zero-point convention). grid: points of the scaling-exponent search in [0, 1).
    clip: search a shrink factor of each group's range. max_tokens: calibration tokens used by the searches.
    """

    sym: bool = False
    grid: int = 20
    clip: bool = True
    max_tokens: int = 4096

    method = "awq"

    def __post_init__(self):
        super().__post_init__()
        if self.grid < 1:
            raise ConfigError(f"grid must be positive, got {self.grid}")


@dataclass(frozen=True)
class AWQGPTQConfig(GPTQConfig):
    """AWQ's activation-aware scales folded in first, then GPTQ's error-compensating rounding of the scaled weights.

    GPTQ's options as in ``GPTQConfig``; grid and max_tokens as in ``AWQConfig`` (the scale search). No AWQ clip
    search: GPTQ's rounding takes its place, and clipping first measured worse (``toolkit.methods.awq_gptq``).
    sym defaults to False, as AWQ's: on SmolLM2-135M W4 g64 the held-out perplexity was 26.9 asymmetric against 33.3
    symmetric (tests/methods/test_real_model_ordering.py). Asymmetric weights go to --format awq or compressed-tensors.
    """

    sym: bool = False
    grid: int = 20
    max_tokens: int = 4096

    method = "awq+gptq"

    def __post_init__(self):
        super().__post_init__()
        if self.grid < 1:
            raise ConfigError(f"grid must be positive, got {self.grid}")


METHODS: dict[str, type[WeightQuantConfig]] = {
    "rtn": RTNConfig, "gptq": GPTQConfig, "awq": AWQConfig, "awq+gptq": AWQGPTQConfig,
}


def make_config(method: str, **options) -> WeightQuantConfig:
    """Build the config of ``method`` from keyword options, ignoring ``None`` (unset CLI options)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(sorted(METHODS))}")
    cls = METHODS[method]
    known = {f.name for f in fields(cls)}
    unknown = {k for k, v in options.items() if v is not None and k not in known}
    if unknown:
        raise ConfigError(f"method {method!r} takes no option(s) {', '.join(sorted(unknown))}")
    return cls(**{k: v for k, v in options.items() if v is not None})
