"""How much memory a quantize run needs, estimated before it starts, and a refusal when that is more than there is.

Counted from the model's shapes (a meta-device skeleton is enough), float32 as the engine computes:

| part | streamed (``--stream``) | in memory |
|---|---|---|
| runtime | Python, torch, transformers, tokenizer (~0.5 GiB measured) | same |
| float weights | one decoder layer | the whole model |
| embeddings | embeddings + final norm (the LM head is read only when written) | (in the model) |
| activations | samples × seq_len × hidden, twice (a layer's inputs and outputs); one batch with offload | same |
| forward | one batch: 3 MLP-wide tensors, 2 attention-score tensors, and 3 copies of the largest linear | same |
| replay | GPTQ true-sequential, activations in memory: o_proj's and down_proj's inputs (samples × seq_len × (hidden + the widest input)), kept so attention and the MLP are not recomputed | same |
| statistics | a Hessian (``needs_hessian``, GPTQ): 3 × K² for the widest input K (the Hessian, then its permuted copy and Cholesky factor, then the factor and its inverse: two at a time, plus allocator slack), 4 × K² with ``refit_rounds`` (the Hessian kept); a scale search (``searches_scales``, AWQ): max_tokens × every input | same |
| float stream | ``follows_float_model`` (SignRound, GPTQ's ``float_targets``): the float model's inputs and outputs of the layer, 2 × samples × seq_len × hidden (one batch with offload); with ``float_targets`` also the float model's input of every linear of the layer (samples × seq_len × the inputs' widths summed: an upper bound, linears sharing an input keep it once) | same |
| learned rounding | ``learns_rounding`` (SignRound): 8 copies of the layer's linear weights (offsets, their best copy and gradient, the fake-quantized weights and their intermediates), and the backward of one batch (twice the forward row) | same |
| rotation | — (``--rotate`` needs the model in memory) | ``--rotate``: the LM head it may untie (a tied one in a family whose residual stream it rotates), and 3 float64 copies of the largest matrix it folds at once |
| output | one packed layer, twice (tensors and safetensors' serialized bytes) | the whole packed model, twice |

An estimate, not a measurement: it aims a little high, so that a refusal is never a close call.

``disk_estimate`` counts the disk a run writes the same way: the checkpoint (the output row's packed linears of every
layer, every other tensor in the saved dtype, a head the rotation may untie, and ``EXTRAS`` for tokenizer and
configs), the finished layers saved until it is written (``toolkit.engine.resume``: a byte per code, float32 scale
and zero per group, the layers' other parameters in float32) and, with offload, the activations row on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from toolkit.models import arch_spec, decoder_layers, layer_linears
from toolkit.quant.configs import ConfigError, WeightQuantConfig
from toolkit.rotate import ROTATED_ROWS

GiB = 2**30
RUNTIME = GiB // 2
FLOAT = 4  # bytes per float32 value
EXTRAS = 64 * 2**20  # tokenizer files, configs and manifest of a checkpoint (the largest tokenizers are ~35 MB)


class MemoryLimitError(ConfigError):
    """A run whose estimated memory exceeds what the machine has available."""


@dataclass
class MemoryEstimate:
    """Bytes by part (in the order of the table above); ``total`` is their sum."""

    streamed: bool
    offload: bool = False
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def summary(self) -> str:
        """One line: the mode, the total and every part, in GiB."""
        mode = "streamed" if self.streamed else "in memory"
        parts = ", ".join(f"{name} {size / GiB:.2f}" for name, size in self.parts.items())
        return f"memory estimate ({mode}): {self.total / GiB:.2f} GiB = {parts}"


def estimate(
    model: nn.Module,
    config: WeightQuantConfig,
    samples: int,
    seq_len: int,
    *,
    streamed: bool,
    offload: bool = False,
    batch_size: int = 8,
) -> MemoryEstimate:
    """The memory a quantize run of ``model`` (its shapes; weights may be on the meta device) needs, calibrating on
    ``samples`` sequences of ``seq_len`` tokens (0 samples: a method that needs no activations)."""
    layers = decoder_layers(model)
    layer_values = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    model_values = sum(p.numel() for p in model.parameters())
    lm_head = getattr(model, "lm_head", None)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_values = 0 if lm_head is None or tied else lm_head.weight.numel()
    outer_values = model_values - sum(p.numel() for p in layers.parameters()) - head_values
    linears = list(layer_linears(layers[0]).values())
    hidden = model.config.hidden_size
    batch = min(batch_size, samples)

    parts = {"runtime": RUNTIME}
    if streamed:
        parts["float layer"] = layer_values * FLOAT
        parts["embeddings"] = outer_values * FLOAT
    else:
        parts["float model"] = model_values * FLOAT
    if samples:
        held = batch if offload else samples
        parts["activations"] = 2 * held * seq_len * hidden * FLOAT
        heads = getattr(model.config, "num_attention_heads", 1)
        per_token = 3 * max(m.out_features for m in linears) + 2 * heads * seq_len  # MLP, attention scores
        parts["forward"] = batch * seq_len * per_token * FLOAT + 3 * max(m.weight.numel() for m in linears) * FLOAT
    if samples and not offload and getattr(config, "true_sequential", False):
        parts["replay inputs"] = samples * seq_len * (hidden + max(m.in_features for m in linears)) * FLOAT
    if config.needs_hessian:
        kept = 1 if getattr(config, "refit_rounds", 0) else 0  # the refits keep the Hessian beside its factor
        parts["hessians"] = (3 + kept) * max(m.in_features for m in linears) ** 2 * FLOAT
    if config.searches_scales:
        parts["awq inputs"] = config.max_tokens * sum(m.in_features for m in linears) * FLOAT
    if config.follows_float_model and samples:
        parts["float stream"] = 2 * (batch if offload else samples) * seq_len * hidden * FLOAT
    if config.follows_float_model and config.needs_hessian and samples:
        parts["float inputs"] = samples * seq_len * sum(m.in_features for m in linears) * FLOAT
    if config.learns_rounding and samples:
        parts["learned rounding"] = 8 * sum(m.weight.numel() for m in linears) * FLOAT + 2 * parts["forward"]
    if config.rotate != "none":  # the head it may untie, float64 copies of the largest matrix it folds at once
        folded = max(max(m.weight.numel() for m in linears), ROTATED_ROWS * hidden)
        parts["rotation"] = _untied_head(model, config) * FLOAT + 3 * folded * 8
    packed_layer = sum(_packed_bytes(m.weight.numel(), config) for m in linears)
    parts["output"] = 2 * packed_layer * (1 if streamed else len(layers))
    return MemoryEstimate(streamed, offload, parts)


def _untied_head(model: nn.Module, config: WeightQuantConfig) -> int:
    """Weights of the LM head ``config.rotate`` may untie (``toolkit.rotate``): a tied head, in a family whose
    residual stream it rotates, unless the final norm turns out to be one number (not known before loading)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if config.rotate == "none" or not tied or not arch_spec(model).rotates_residual:
        return 0
    return model.get_input_embeddings().weight.numel()


def disk_estimate(
    model: nn.Module, config: WeightQuantConfig, samples: int, seq_len: int, dtype_size: int, *, offload: bool
) -> int:
    """Bytes a quantize run of ``model`` (its shapes) writes beside its output: the checkpoint, whose unquantized
    tensors take ``dtype_size`` bytes a value, its layers saved for a resume, and with ``offload`` two layers'
    activations of ``samples`` × ``seq_len`` tokens."""
    linears = [m for layer in decoder_layers(model) for m in layer_linears(layer).values()]
    quantized = sum(m.weight.numel() for m in linears)
    float_values = sum(p.numel() for p in model.parameters()) - quantized
    float_values += _untied_head(model, config)
    written = sum(_packed_bytes(m.weight.numel(), config) for m in linears) + float_values * dtype_size + EXTRAS
    group = quantized if config.group_size == -1 else config.group_size
    saved_layers = sum(p.numel() for p in decoder_layers(model).parameters()) - quantized
    written += quantized + quantized // group * 2 * FLOAT + saved_layers * FLOAT
    if offload:
        written += 2 * samples * seq_len * model.config.hidden_size * FLOAT
    return written


def _packed_bytes(values: int, config: WeightQuantConfig) -> int:
    """Bytes of one packed linear: ``bits`` per weight plus a 16-bit scale and a zero point per group."""
    group = values if config.group_size == -1 else config.group_size
    return values * config.bits // 8 + (values // group) * (2 + config.bits)


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes (what the kernel can give without swapping), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(needed: MemoryEstimate, available: int | None, streamed_alternative: MemoryEstimate | None) -> None:
    """Refuse a run whose estimate exceeds ``available`` bytes, saying what would make it fit: ``--stream`` (when
    ``streamed_alternative``, the same run streamed, would fit), fewer ``--samples``, ``--offload-activations``."""
    if available is None or needed.total <= available:
        return
    mode = "streamed" if needed.streamed else "in memory"
    ways = []
    if streamed_alternative is not None and streamed_alternative.total <= available:
        ways.append(f"--stream (about {streamed_alternative.total / GiB:.1f} GiB)")
    activations = needed.parts.get("activations", 0)
    if activations and not needed.offload:
        ways.append(f"fewer --samples (the activations take {activations / GiB:.1f} GiB)")
        ways.append("--offload-activations (activations on disk)")
    if not needed.streamed and not ways:
        ways.append("--stream from a local safetensors directory")
    ways = ways or ["a machine with more memory"]
    raise MemoryLimitError(
        f"this run needs about {needed.total / GiB:.1f} GiB ({mode}) but {available / GiB:.1f} GiB is available "
        f"({needed.summary()}); try {', or '.join(ways)}"
    )
