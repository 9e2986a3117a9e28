"""The ``quantize`` verb: model spec + config + calibration data → a deployable checkpoint directory."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit import __version__
from toolkit.engine import Progress, check_widths, quantize_layers
from toolkit.formats import awq as awq_format
from toolkit.formats import compressed_tensors as ct_format
from toolkit.formats import gptq as gptq_format
from toolkit.formats.checkpoint import write_checkpoint
from toolkit.methods import driver_for
from toolkit.models import load_model, load_tokenizer
from toolkit.quant.configs import ConfigError, WeightQuantConfig

FORMATS = {"gptq": gptq_format, "awq": awq_format, "compressed-tensors": ct_format}


def choose_format(config: WeightQuantConfig) -> str:
    """The format ``auto`` stands for: GPTQ for symmetric weights, AWQ for asymmetric 4-bit groups (the layouts
    with the widest engine support), compressed-tensors for what neither stores."""
    if config.sym and config.bits in gptq_format.SUPPORTED_BITS:
        return "gptq"
    if not config.sym and config.bits == 4 and config.group_size != -1:
        return "awq"
    return "compressed-tensors"


@dataclass
class CalibrationSpec:
    """Where calibration tokens come from: a source the calibration pipeline reads, and how many."""

    dataset: str = "sharegpt"
    samples: int = 128
    seq_len: int = 512
    text_field: str = "text"


@dataclass
class QuantizeResult:
    """What a quantize run produced and what it cost."""

    output: Path
    seconds: float
    peak_rss_mb: float
    errors: dict[str, float] = field(default_factory=dict)


def quantize(
    model_spec: str,
    config: WeightQuantConfig,
    output: Path | str,
    calibration: CalibrationSpec | None = None,
    *,
    fmt: str = "auto",
    dtype: torch.dtype = torch.float16,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: Progress | None = None,
) -> QuantizeResult:
    """Quantize ``model_spec`` with ``config`` and write a ``fmt`` checkpoint to ``output`` (atomically).

    Steps: 1. refuse unsupported format settings and an existing output; 2. load tokenizer and model;
    3. check group size against every linear; 4. build calibration tokens (methods that need them);
    5. quantize layer by layer, packing each linear as it finishes; 6. write the checkpoint.
    """
    started = time.perf_counter()
    calibration = calibration or CalibrationSpec()
    output = Path(output)
    fmt = choose_format(config) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; choose auto or one of {', '.join(FORMATS)}")
    layout = FORMATS[fmt]
    layout.check_supported(config)  # 1
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    tokenizer = load_tokenizer(model_spec, trust_remote_code)  # 2
    model = load_model(model_spec, torch.float32, trust_remote_code)
    check_widths(model, config)  # 3
    tokens, calib_info = None, {}
    if config.needs_activations:  # 4
        from toolkit.calibration import calibration_batch, fingerprint

        if progress:
            progress.step(f"building {calibration.samples}×{calibration.seq_len} calibration tokens")
        tokens = calibration_batch(
            tokenizer, calibration.dataset, calibration.samples, calibration.seq_len, config.seed,
            text_field=calibration.text_field,
        )
        calib_info = {**vars(calibration), "seed": config.seed, "fingerprint": fingerprint(tokens)}
    packed: dict[str, dict[str, torch.Tensor]] = {}

    def sink(name, qweight):
        packed[name] = layout.pack(qweight, dtype)

    errors = quantize_layers(model, config, driver_for(config.method), tokens, sink, progress=progress)  # 5
    manifest = {
        "compound_version": __version__,
        "format": fmt,
        "model": model_spec,
        "quantization": config.to_dict(),
        "calibration": calib_info or None,
    }
    write_checkpoint(output, model, tokenizer, packed, layout.quantization_config(config), manifest, dtype, overwrite)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return QuantizeResult(output, time.perf_counter() - started, peak, errors)
