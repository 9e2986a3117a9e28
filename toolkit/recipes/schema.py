"""The recipe schema: one frozen dataclass per section, each checking its own values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.evaluate.options import EvalOptions, HeadsCheckOptions
from toolkit.formats import resolve
from toolkit.hub_options import PushOptions
from toolkit.options import check_choices, option, option_fields
from toolkit.quant.configs import METHODS, ConfigError, MethodChoice, WeightQuantConfig, make_config
from toolkit.quantize import CalibrationSpec, QuantizeSettings
from toolkit.train_heads import HeadsJob


class RecipeError(ValueError):
    """A recipe that cannot run; the message starts with ``file:line: key:``."""


class SettingError(ValueError):
    """Raised by a section's checks: the key at fault ("" for the section) and what is wrong with it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class QuantizeSection:
    """The recipe's ``quantize`` section: the method's config and the run's settings. Its keys are exactly the
    ``compound quantize`` flags: ``method`` (``MethodChoice``), every ``QuantizeSettings`` field and every option of the
    quantization configs (``keys``); a method option the chosen method does not take is refused."""

    config: WeightQuantConfig
    settings: QuantizeSettings

    @classmethod
    def from_mapping(cls, values: dict) -> QuantizeSection:
        """Build from the section's typed values (``method`` may be absent: the CLI's default)."""
        try:
            method = MethodChoice(**{k: v for k, v in values.items() if k == "method"}).method
        except ConfigError as err:
            raise SettingError("method", str(err).removeprefix("--method ")) from None
        names = {f.name for f in option_fields(QuantizeSettings)}
        try:
            settings = QuantizeSettings(**{k: v for k, v in values.items() if k in names})
        except ConfigError as err:
            key = str(err).split(" ")[0].removeprefix("--").replace("-", "_")  # a flag's message names it "--x-y"
            raise SettingError(key, str(err)) from None
        options = {k: v for k, v in values.items() if k not in names and k != "method"}
        try:
            config = make_config(method, **options)
        except ConfigError as err:
            raise SettingError(next((k for k in options if k in str(err)), ""), str(err)) from None
        layout, _ = resolve(settings.format, config)
        try:
            layout.check_supported(config)
        except ConfigError as err:
            raise SettingError("format", f"{layout.NAME}: {err}") from None
        return cls(config, settings)


    @staticmethod
    def keys() -> dict[str, type]:
        """Every key of the section with the dataclass declaring it (the first, for method options)."""
        keys: dict[str, type] = {}
        for cls in (MethodChoice, QuantizeSettings, *METHODS.values()):
            for f in option_fields(cls):
                keys.setdefault(f.name, cls)
        return keys


@dataclass(frozen=True)
class HeadsSection:
    """The recipe's ``heads`` section: its keys are exactly the ``compound train-heads`` flags that describe the heads
    (``head`` and every field of the job's option dataclasses, ``HeadsJob.parts``)."""

    head: str
    parts: dict  # field name of HeadsJob → its options instance
    device: str  # where it trains (``toolkit.engine.devices``)

    @staticmethod
    def keys() -> dict[str, type]:
        """Every key of the section with the dataclass declaring it."""
        keys = {f.name: HeadsJob for f in option_fields(HeadsJob)}
        for cls in HeadsJob.parts().values():
            keys.update({f.name: cls for f in option_fields(cls)})
        return keys

    @classmethod
    def from_mapping(cls, values: dict) -> HeadsSection:
        """Build from the section's typed values, each option dataclass checking its own."""
        head = values.get("head", _default("head", HeadsJob))
        device = values.get("device", _default("device", HeadsJob))
        try:
            HeadsJob(model="", output=Path(), head=head, device=device)  # its own checks: the head kinds, the devices
        except ValueError as err:
            raise SettingError(getattr(err, "option", "head"), str(err)) from None
        parts = {}
        for name, part in HeadsJob.parts().items():
            given = {f.name: values[f.name] for f in option_fields(part) if f.name in values}
            try:
                parts[name] = part(**given)
            except ValueError as err:  # the option's own rules (batch_size a multiple of micro_batch_size, ...)
                raise SettingError(next((k for k in given if k in str(err)), ""), str(err)) from None
        return cls(head, parts, device)

    def job(self, model: str, output: Path, work_dir: Path) -> HeadsJob:
        """The ``train-heads`` job of this section against ``model``, resumable in ``work_dir``."""
        return HeadsJob(model=model, output=output, head=self.head, device=self.device, **self.parts,
                        work_dir=work_dir, overwrite=True)


def _default(name: str, cls):
    return next(f.default for f in option_fields(cls) if f.name == name)


@dataclass(frozen=True)
class EvaluateSection(EvalOptions, HeadsCheckOptions):
    """The recipe's ``evaluate`` section: its keys are exactly the ``compound eval`` options of the evaluate step
    (``EvalOptions``: windows × seq_len held-out tokens per slice of ``calibration.dataset``, the generation checks) and
    the ``compound validate --heads`` options of the heads_eval step (``HeadsCheckOptions``)."""

    def __post_init__(self):
        EvalOptions.__post_init__(self)
        HeadsCheckOptions.__post_init__(self)
        if "all" not in self.categories:
            raise SettingError("categories", "must include all: the gates and the model card read the accepted "
                                             "length over all prompts")


@dataclass(frozen=True)
class GatesSection:
    """Thresholds the run must meet before anything is pushed; None leaves a measure ungated.

    From ``eval.json`` (over all slices): max_perplexity_increase: quantized minus float perplexity;
    max_perplexity_ratio: their ratio; max_slice_perplexity_ratio: the ratio on the slice that degrades most; max_kl:
    mean KL(float ‖ quantized) in nats per token; min_top1_agreement: in [0, 1]. min_accepted_length: mean tokens per
    target forward in ``accepted_length_mode`` (chain: what vLLM serves; tree: compound's loop).
    """

    max_perplexity_increase: float | None = None
    max_perplexity_ratio: float | None = None
    max_slice_perplexity_ratio: float | None = None
    min_top1_agreement: float | None = None
    max_kl: float | None = None
    min_accepted_length: float | None = None
    accepted_length_mode: str = option("chain", "tree: compound's loop; chain: what vLLM serves.",
                                       choices=("tree", "chain"))
    lossless_required: bool = True
    validate_required: bool = True

    def __post_init__(self):
        check_choices(self)
        for key in ("max_perplexity_increase", "max_kl"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise SettingError(key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("max_perplexity_ratio", "max_slice_perplexity_ratio"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise SettingError(key, f"must be >= 1 (quantized / float), got {getattr(self, key)}")
        if self.min_top1_agreement is not None and not 0 <= self.min_top1_agreement <= 1:
            raise SettingError("min_top1_agreement", f"must be in [0, 1], got {self.min_top1_agreement}")
        if self.min_accepted_length is not None and self.min_accepted_length < 1:
            raise SettingError("min_accepted_length", f"must be >= 1 (tokens per target forward), got "
                                                  f"{self.min_accepted_length}")


@dataclass(frozen=True)
class PushSection(PushOptions):
    """Where the artifacts go once every gate passed: its keys are the ``compound push`` options (``PushOptions``:
    the checkpoint goes to ``repo``) and two of the recipe's own: ``heads_repo``, where the heads go (default
    ``<repo>-<head kind>``), and ``enabled`` (false: never push). Without a Hub token the push is skipped."""

    heads_repo: str | None = None
    enabled: bool = True

    def __post_init__(self):
        for key in ("repo", "heads_repo"):
            value = getattr(self, key)
            if value is not None and (value.count("/") != 1 or "" in value.split("/")):
                raise SettingError(key, f"must be owner/name, got {value!r}")

    def heads_repo_for(self, head: str) -> str:
        """The heads' repo: ``heads_repo``, else ``<repo>-<head kind>`` (``-medusa``, ``-eagle3``)."""
        return self.heads_repo or f"{self.repo}-{head}"


@dataclass(frozen=True)
class Recipe:
    """One pipeline: a model, its sections (quantize, heads and push optional), and where its artifacts go."""

    name: str
    model: str
    output: Path
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)
    quantize: QuantizeSection | None = None
    heads: HeadsSection | None = None
    evaluate: EvaluateSection = field(default_factory=EvaluateSection)
    gates: GatesSection = field(default_factory=GatesSection)
    push: PushSection | None = None
    source: Path | None = None  # the file it was loaded from

    def __post_init__(self):
        if self.quantize is None and self.heads is None:
            raise SettingError("", "a recipe needs a quantize or a heads section (or both)")
        gates = self.gates
        for key in ("max_perplexity_increase", "max_perplexity_ratio", "max_slice_perplexity_ratio", "min_top1_agreement",
                    "max_kl"):
            if getattr(gates, key) is not None and self.quantize is None:
                raise SettingError(f"gates.{key}", "measures the quantized model, and the recipe has no quantize section")
        if gates.min_accepted_length is not None and self.heads is None:
            raise SettingError("gates.min_accepted_length", "measures the heads, and the recipe has no heads section")

    @property
    def checkpoint(self) -> Path:
        return self.output / "checkpoint"

    @property
    def heads_dir(self) -> Path:
        return self.output / "heads"

    @property
    def heads_target(self) -> str:
        """The model the heads draft for: the quantized checkpoint when the recipe makes one (heads are trained
        against the model they serve), else the float model."""
        return str(self.checkpoint) if self.quantize else self.model


SECTIONS = {"calibration": CalibrationSpec, "quantize": QuantizeSection, "heads": HeadsSection,
            "evaluate": EvaluateSection, "gates": GatesSection, "push": PushSection}
# Keys renamed to the verbs' option names: still read, with a warning naming the new key.
RENAMED = {"evaluate": {"new_tokens": "max_new_tokens"}, "push": {"repo_id": "repo", "heads_repo_id": "heads_repo"}}
TOP_LEVEL = ("model", "output", *SECTIONS)
