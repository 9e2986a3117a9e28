"""Frozen, self-validating configs for each quantization method, and the registry that maps a method name to one.

A config names the numerics it produces and checks itself on construction, so a bad request fails before any
calibration runs. ``check_width`` checks it against a real model's linears. Each method's class declares once what
the rest of compound asks of it: its name (``method``), its capabilities (class attributes, documented on
``WeightQuantConfig``) and its user-settable options (fields made with ``toolkit.options.option``, from which the
CLI flags and recipe keys are derived). Its layer driver and error measure are registered by its driver module
(``toolkit.methods``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from toolkit.options import TRAIN_DTYPES, check_choices, choices_of, flag_of, help_of, option

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
# what an unset group size may become, largest (fewest scales) first
STANDARD_GROUP_SIZES = tuple(sorted((g for g in SUPPORTED_GROUP_SIZES if g > 0), reverse=True))
ROTATIONS = ("none", "hadamard")  # --rotate: none, or the randomized Hadamard one of toolkit.quant.rotation


class ConfigError(ValueError):
    """A quantization request that cannot be honoured; the message names the value and the fix."""


@dataclass(frozen=True)
class WeightQuantConfig:
    """Integer weight-only quantization shared by every method.

    bits: code width, 2..8. group_size: input columns per scale (-1: per output channel; 32/64/128); None until
    ``fitted`` to a model, which makes it the largest of ``STANDARD_GROUP_SIZES`` dividing every quantized width.
    sym: symmetric grid (zero fixed at 2^(bits-1)). full_range: a symmetric grid whose scale puts each group's
    largest-magnitude weight on code 0 (``FULL_RANGE_RULE``), so all 2^bits codes serve. skip: module names or suffixes left in float (lm_head by default).
    gguf: the codes are for llama.cpp's GGUF blocks too (``quantize`` writes the GGUF file beside the checkpoint):
    the quantizers use ``scale_rule`` GGUF's (a symmetric group's largest-magnitude value on code 0 as llama.cpp's
    Q4_0, scales rounded to fp16 before codes are chosen), and an unset group size becomes 32, the block size.
    act_order / static_groups: the column order the codes were chosen in, which every format must record (only
    methods that reorder columns accept act_order: see ``GPTQConfig``).

    Capabilities (class attributes a method overrides): ``needs_activations``, it reads calibration activations;
    ``needs_hessian``, it accumulates a K×K Hessian per input (GPTQ's statistics, counted by the memory estimate);
    ``searches_scales``, it runs AWQ's scale search on ``max_tokens`` tokens (kept per input, counted likewise);
    ``reorders_columns``, it honours act_order; ``data_parallel``, it can split its calibration over torchrun ranks;
    ``learns_rounding``, it learns the rounding on each layer's output by gradient descent (SignRound: float targets,
    the learned state and one batch's backward, counted likewise).
    moe_calibration / moe_min_tokens: what the experts of a Mixture-of-Experts layer are calibrated on, and below how
    many routed tokens an expert's linears fall back to round-to-nearest (``toolkit.engine.loop``).
    rotate: the rotation folded into the float weights before any method runs (``toolkit.rotate``), seeded by
    ``seed``; recorded with the rest of the config in the manifest.
    """

    bits: int = option(4, "Weight bits (2..8; the GPTQ format stores 2, 3, 4 or 8).")
    group_size: int | None = option(None, "Input columns per scale: 32, 64, 128, or -1 for per channel (default: the "
                                          "largest of 128, 64, 32 that divides every quantized linear's input width).")
    sym: bool = option(False, "Symmetric grid (default: asymmetric, the closest to the float model of the two on both "
                              "embedded models; --sym for GGUF's Q4_0 and the GPTQ layout).", flag="--sym/--asym")
    gguf: bool = option(False, "Also write the checkpoint as one GGUF file for llama.cpp inside --output "
                        "(<name>-Q4_0.gguf from symmetric 4-bit, -Q4_1 from asymmetric, -Q8_0 from symmetric 8-bit), "
                        "with codes chosen on its grid (llama.cpp's Q4_0 scale rule, fp16 scales) and written as "
                        "they are: group size 32 (the default with --gguf), no dynamic act-order, a llama model.",
                        flag="--gguf/--no-gguf")
    full_range: bool = option(False, "Symmetric grid over all 2^bits codes: each group's largest-magnitude weight "
                                     "on an end code, as llama.cpp's Q4_0 and AutoRound's (scales are negative where "
                                     "that weight is positive); default: the GPTQ reference grid, which leaves the "
                                     "top code's step unused. --gguf implies it.", flag="--full-range/--no-full-range")
    skip: tuple[str, ...] = option(("lm_head",), "Module names (or suffixes) left unquantized; repeatable.")
    seed: int = option(0, "Seed for calibration sampling and any random choice.")
    act_order: bool = option(False, "GPTQ: decreasing-Hessian column order, static groups (default on).",
                             flag="--act-order/--no-act-order")
    static_groups: bool = option(True, "GPTQ: with act_order and groups, fix the groups in original column order "
                                       "(vLLM refuses desc_act with groups otherwise).")
    moe_calibration: str = option("routed", "Mixture-of-Experts: each expert's statistics from the calibration tokens "
                                            "routed to it (routed), or from every token (all; the layer's output "
                                            "keeps the true routing).", choices=("routed", "all"))
    moe_min_tokens: int = option(16, "Mixture-of-Experts: an expert routed fewer calibration tokens than this is "
                                     "rounded to nearest instead (listed in the output and the manifest).")
    rotate: str = option("none", "Fold an orthogonal rotation into the weights before quantizing, any method: none | "
                         "hadamard (a randomized Hadamard rotation of the residual stream, norms folded into the "
                         "linears, and of each attention head's values; families with norms on the attention and MLP "
                         "outputs, Gemma 2/3, get the values' rotation only). The checkpoint stays a standard model "
                         "of its family; a tied LM head is untied where the final norm requires it.",
                         choices=ROTATIONS)
    version: int = field(default=1, repr=False)

    method: ClassVar[str] = "base"
    needs_activations: ClassVar[bool] = True
    needs_hessian: ClassVar[bool] = False
    searches_scales: ClassVar[bool] = False
    reorders_columns: ClassVar[bool] = False
    data_parallel: ClassVar[bool] = False
    learns_rounding: ClassVar[bool] = False

    @property
    def follows_float_model(self) -> bool:
        """Whether the engine carries the float model's activations beside the quantized ones for this method
        (``toolkit.engine.loop``): a learner's targets (``learns_rounding``), GPTQ's ``float_targets``."""
        return self.learns_rounding

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"bits must be between 2 and 8, got {self.bits}")
        if self.group_size is not None and self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ConfigError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}")
        if self.moe_min_tokens < 0:
            raise ConfigError(f"--moe-min-tokens must be 0 or more, got {self.moe_min_tokens}")
        check_choices(self, ConfigError)
        if self.full_range and not self.sym:
            raise ConfigError(f"--full-range is a symmetric grid; method {self.method!r} is asymmetric here: pass "
                              "--sym with it, or drop --full-range")
        if self.act_order and not self.reorders_columns:
            raise ConfigError(f"act_order is a GPTQ option; method {self.method!r} has none "
                              f"(use {' or '.join(methods_that('reorders_columns'))})")

    def fitted(self, widths: dict[str, int]) -> tuple[WeightQuantConfig, str | None]:
        """This config for a model whose quantized linears have input ``widths`` (name → in_features), and why its
        group size is what it is (None when it was given). An unset group size becomes the largest of
        ``STANDARD_GROUP_SIZES`` that divides every width; a given one is checked against each (``check_width``)."""
        if self.group_size is not None:
            for name, in_features in widths.items():
                self.check_width(name, in_features)
            return self, None
        if self.gguf:
            from toolkit.quant.primitives import GGUF_BLOCK_SIZE

            fitted = dataclasses.replace(self, group_size=GGUF_BLOCK_SIZE)
            for name, in_features in widths.items():
                fitted.check_width(name, in_features)
            return fitted, f"auto: GGUF blocks hold {GGUF_BLOCK_SIZE} weights (--gguf)"
        distinct = sorted(set(widths.values()))
        for size in STANDARD_GROUP_SIZES:
            if all(k % size == 0 for k in distinct):
                larger = [g for g in STANDARD_GROUP_SIZES if g > size]
                why = f"auto: the largest of {', '.join(map(str, STANDARD_GROUP_SIZES))} dividing every input width"
                if larger:
                    name, width = next((n, k) for n, k in widths.items() if k % larger[-1])
                    why += f"; {larger[-1]} does not divide {width} ({name})"
                return dataclasses.replace(self, group_size=size), why
        raise ConfigError(f"no group size of {', '.join(map(str, STANDARD_GROUP_SIZES))} divides every quantized "
                          f"linear's input width ({', '.join(map(str, distinct))}); pass --group-size -1 (per channel)")

    def check_width(self, name: str, in_features: int) -> None:
        """Refuse a linear whose input width the group size does not divide."""
        if self.group_size != -1 and in_features % self.group_size:
            options = [g for g in SUPPORTED_GROUP_SIZES if g == -1 or in_features % g == 0]
            raise ConfigError(
                f"group_size {self.group_size} does not divide the input width of {name} "
                f"({in_features} % {self.group_size} = {in_features % self.group_size}); "
                f"try --group-size {' or '.join(str(g) for g in options)}"
            )

    @property
    def scale_rule(self):
        """How the quantizers turn a group's range into its scale (``toolkit.quant.primitives.ScaleRule``): GGUF's
        for a GGUF target, the full range's with ``full_range``, else the GPTQ reference grid's."""
        from toolkit.quant.primitives import FULL_RANGE_RULE, GGUF_RULE, GPTQ_RULE

        return GGUF_RULE if self.gguf else FULL_RANGE_RULE if self.full_range else GPTQ_RULE

    def to_dict(self) -> dict:
        """Plain dict of every field plus the method name, for manifests and fingerprints."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["skip"] = list(self.skip)
        return {"method": self.method, **out}


def describe_act_order(act_order: bool, static_groups: bool, group_size: int | None) -> str:
    """The column order codes were chosen in, in the manifest's terms: "on (static groups)", "on (dynamic groups)",
    "on (per channel)" or "off"."""
    if not act_order:
        return "off"
    if group_size == -1:
        return "on (per channel)"
    return "on (static groups)" if static_groups else "on (dynamic groups)"


def _option_of(cls: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """``cls``'s option ``name`` declared again (same help, choices and flag), with ``default`` or the same one:
    for a method whose default differs, or that shares an option with a class it does not derive from."""
    declared = next(f for f in fields(cls) if f.name == name)
    default = declared.default if default is dataclasses.MISSING else default
    return option(default, help_of(declared), choices=choices_of(declared), flag=flag_of(declared))


@dataclass(frozen=True)
class RTNConfig(WeightQuantConfig):
    """Round-to-nearest on per-group min/max: no calibration data needed."""

    method = "rtn"
    needs_activations = False
    data_parallel = True


@dataclass(frozen=True)
class GPTQConfig(WeightQuantConfig):
    """GPTQ (arXiv 2210.17323): column-by-column rounding with Hessian-based error compensation.

    damp: dampening added to the Hessian diagonal, relative to its mean (raised automatically when Cholesky fails).
    block_size: columns per lazy-update block. act_order: process columns by decreasing Hessian diagonal (on by
    default: with static groups it costs nothing at run time, and on SmolLM2-135M W4 g64 it is what lets GPTQ beat
    RTN at all; llm-compressor's default too). static_groups: with act_order and groups, fix the groups in original
    column order (vLLM refuses desc_act with groups otherwise). mse_clip: search each group's range for the lowest
    rounding error weighted by each input's mean square (diag H, llama.cpp's importance matrix) instead of min/max:
    both ends shrunk by one factor, then each end alone (``toolkit.quant.gptq``).
    true_sequential: quantize q/k/v, then o, then gate/up, then down, each seeing the already-quantized ones.
    float_targets: fit W* (``toolkit.quant.gptq.float_target_weights``) instead of W, so each linear also makes up
    for the error of everything quantized before it (the engine carries the float model's activations for it).
    refit_rounds: refits of the group scales to GPTQ's codes (``toolkit.quant.refit``), GPTQ choosing the codes again
    on each refitted grid between two refits; the refit of lowest loss is kept. Each round after the first costs one
    more GPTQ pass per linear, and the Hessian is kept beside its factor.
    """

    damp: float = option(0.01, "GPTQ: dampening relative to the mean Hessian diagonal.")
    block_size: int = option(128, "GPTQ: columns per lazy update block.")
    act_order: bool = _option_of(WeightQuantConfig, "act_order", True)
    mse_clip: bool = option(True, "GPTQ: search each group's range for the lowest rounding error weighted by each "
                                  "input's mean square (llama.cpp's importance matrix) instead of min/max.")
    true_sequential: bool = option(True, "GPTQ: quantize q/k/v, then o, then gate/up, then down, each seeing the "
                                         "already-quantized ones.")
    float_targets: bool = option(False, "GPTQ: fit each linear's output on the quantized model's inputs to the float "
                                        "model's output (GPTAQ's objective) instead of to its float weights' output on "
                                        "the same inputs.", flag="--float-targets/--no-float-targets")
    refit_rounds: int = option(0, "GPTQ: refits of each group's scale to the chosen codes (least squares on the "
                                  "layer's output error), GPTQ choosing the codes again on the refitted grid between "
                                  "two; the best refit is kept (0: off; each round after the first costs one more "
                                  "GPTQ pass per linear).")

    method = "gptq"
    needs_hessian = True
    reorders_columns = True
    data_parallel = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.damp < 1:
            raise ConfigError(f"damp must be in (0, 1), got {self.damp}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.refit_rounds < 0:
            raise ConfigError(f"--refit-rounds must be 0 or more, got {self.refit_rounds}")

    @property
    def follows_float_model(self) -> bool:
        """With ``float_targets``: GPTQ reads the float model's inputs of each linear."""
        return self.float_targets


@dataclass(frozen=True)
class AWQConfig(WeightQuantConfig):
    """AWQ (arXiv 2306.00978): activation-aware per-channel scaling searched on the block output, then clipping.

    grid: points of the scaling-exponent search in [0, 1).
    clip: search a shrink factor of each group's range. max_tokens: calibration tokens used by the searches.
    """

    grid: int = option(20, "AWQ: points of the scaling-exponent search in [0, 1).")
    clip: bool = option(True, "AWQ: search a shrink factor of each group's range.")
    max_tokens: int = option(4096, "AWQ: calibration tokens used by the searches.")

    method = "awq"
    searches_scales = True

    def __post_init__(self):
        super().__post_init__()
        if self.grid < 1:
            raise ConfigError(f"grid must be positive, got {self.grid}")


@dataclass(frozen=True)
class AWQGPTQConfig(GPTQConfig):
    """AWQ's activation-aware scales folded in first, then GPTQ's error-compensating rounding of the scaled weights.

    GPTQ's options as in ``GPTQConfig``; grid and max_tokens as in ``AWQConfig`` (the scale search). No AWQ clip
    search: GPTQ's rounding takes its place, and clipping first measured worse (``toolkit.methods.awq_gptq``).
    """

    grid: int = _option_of(AWQConfig, "grid")
    max_tokens: int = _option_of(AWQConfig, "max_tokens")

    method = "awq+gptq"
    searches_scales = True
    data_parallel = False  # AWQ's search runs in one process

    def __post_init__(self):
        super().__post_init__()
        if self.grid < 1:
            raise ConfigError(f"grid must be positive, got {self.grid}")


@dataclass(frozen=True)
class SignRoundConfig(WeightQuantConfig):
    """SignRound (arXiv 2309.05516, AutoRound): per-weight rounding offsets and per-group clipping ranges learned by
    signed gradient descent on each decoder layer's output (``toolkit.quant.signround``, ``toolkit.methods.signround``).

    iters: iterations per layer (0: round-to-nearest's codes exactly). lr: step of the rounding offsets, decaying
    linearly to 0 (default 1/iters, AutoRound's). minmax_lr: step of the clipping ranges (default lr).
    """

    iters: int = option(200, "SignRound: signed-gradient iterations per decoder layer (0: round-to-nearest).")
    lr: float | None = option(None, "SignRound: step of the rounding offsets, decaying linearly to 0 "
                                    "(default 1/iters).")
    minmax_lr: float | None = option(None, "SignRound: step of the clipping ranges (default --lr).")
    train_dtype: str = option("bfloat16", "SignRound: precision of the layer's forward and backward while it learns: "
                                          "bfloat16 (autocast) | float32.", choices=TRAIN_DTYPES)

    method = "signround"
    learns_rounding = True

    def __post_init__(self):
        super().__post_init__()
        if self.iters < 0:
            raise ConfigError(f"--iters must be 0 or more (0: round-to-nearest), got {self.iters}")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")

    @property
    def rounding_lr(self) -> float:
        """The step of the rounding offsets: ``lr``, or 1/iters when unset."""
        return self.lr if self.lr is not None else 1 / max(self.iters, 1)

    @property
    def clipping_lr(self) -> float:
        """The step of the clipping ranges: ``minmax_lr``, or the rounding step when unset."""
        return self.minmax_lr if self.minmax_lr is not None else self.rounding_lr


METHODS: dict[str, type[WeightQuantConfig]] = {
    cls.method: cls for cls in (RTNConfig, GPTQConfig, AWQConfig, AWQGPTQConfig, SignRoundConfig)
}
DEFAULT_METHOD = RTNConfig.method  # what `compound quantize` and a recipe without `method` run


@dataclass(frozen=True)
class MethodChoice:
    """Which method quantizes (``--method``, a recipe's ``quantize.method``); its options are its config's fields."""

    method: str = option(DEFAULT_METHOD, "Quantization method (awq+gptq: AWQ's scaling, then GPTQ's rounding).",
                         choices=tuple(METHODS))

    def __post_init__(self):
        check_choices(self, ConfigError)


def methods_that(capability: str) -> list[str]:
    """The names of the registered methods whose config declares ``capability`` (``"data_parallel"``, ...)."""
    return [name for name, cls in METHODS.items() if getattr(cls, capability)]


def make_config(method: str, **options) -> WeightQuantConfig:
    """Build the config of ``method`` from keyword options, ignoring ``None`` (unset CLI options)."""
    cls = METHODS[MethodChoice(method).method]  # an unknown method is refused, naming the choices
    known = {f.name for f in fields(cls)}
    unknown = {k for k, v in options.items() if v is not None and k not in known}
    if unknown:
        raise ConfigError(f"method {method!r} takes no option(s) {', '.join(sorted(unknown))}")
    return cls(**{k: v for k, v in options.items() if v is not None})
