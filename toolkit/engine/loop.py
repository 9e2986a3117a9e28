"""The layer-by-layer quantization loop, written once for every architecture and method.

1. Capture what enters the first decoder layer for the calibration batch (hidden states and the keyword arguments
   the model passes every layer: position embeddings, masks).
2. For each decoder layer in turn: hand a ``LayerSession`` to the method's layer driver, which runs the layer with
   hooks to see what its linears see and returns their quantized weights; put the dequantized weights in place;
   run the quantized layer to produce the next layer's inputs.

Only the current layer needs to sit on the compute device, and only the current layer needs weights at all: a
``LayerSource`` loads each layer before its session and releases it afterwards (``toolkit.engine.streaming`` reads layers
from safetensors shards; the default does nothing, for a model already in memory). With ``offload_dir`` the
activations between layers live on disk (``toolkit.engine.offload``). The engine knows no quantization algorithm: a driver
is any ``LayerDriver`` callable, handed in by the caller (``toolkit.methods.driver_for``: the driver each method's
module registered for its config class).

Mixture-of-Experts layers (``toolkit.experts``: one linear per expert projection): before a layer's driver runs,
the engine counts the calibration tokens routed to each expert. With ``moe_calibration="all"`` every expert also reads
every token while the driver collects its statistics (the layer's output keeps the true routing); with ``routed``,
an expert routed fewer than ``moe_min_tokens`` tokens (or none) is listed in ``LayerSession.sparse``, and drivers
round its linears to nearest. Tracing always runs every expert on every token, so every expert's linears are traced.
While the driver runs, each expert records the routing weight of every row it reads (``LayerSession.row_weights``),
for statistics that weigh a token as the layer's output does (GPTQ's Hessians, AWQ's statistics).

Nothing non-finite gets through: each layer's weights are checked when it is loaded, each linear's scales when its
driver returns them, and the activations after the embeddings and after every layer (``NonFiniteError``, naming the
decoder layer and the tensor).

A method that fits the float model's outputs (``follows_float_model``: SignRound, GPTQ's ``float_targets``) gets
them from a second stream: the engine runs each layer on the float model's inputs before the driver changes its
weights (``LayerSession.float_outputs``), and those outputs enter the next layer's ``reference``.

A layer's inputs, its session and the replay of o_proj/down_proj for their parents live in ``toolkit.engine.session``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from toolkit.engine.heap import trim_heap
from toolkit.engine.offload import DiskActivations
from toolkit.engine.resume import LayerCheckpoints
from toolkit.engine.session import LayerSession, capture_layer_inputs
from toolkit.experts import every_token, expert_index, weighing_rows
from toolkit.models import arch_spec, decoder_layers, layer_linears
from toolkit.quant.configs import WeightQuantConfig
from toolkit.quant.finite import NonFiniteError, all_finite
from toolkit.quant.primitives import QuantizedWeight


class LayerDriver(Protocol):
    """A method's per-layer step: quantize the session's linears, return their weights by relative name."""

    def __call__(self, session: LayerSession) -> dict[str, QuantizedWeight]: ...


class LayerSource(Protocol):
    """Where decoder layers' weights come from: ``load`` fills layer ``index`` before its session (after the first
    layer's inputs were captured, so layer 0's load may free what only the capture needed); ``release`` runs once the
    layer is quantized and has produced the next layer's inputs (and its quantized weights were sunk)."""

    def load(self, index: int, layer: nn.Module) -> None: ...

    def release(self, index: int, layer: nn.Module) -> None: ...


class InMemory:
    """The layer source of a model whose weights are all in memory: nothing to load or release."""

    def load(self, index, layer):
        pass

    def release(self, index, layer):
        pass


class Progress(Protocol):
    """What the engine reports while it runs (the CLI renders it with Rich)."""

    def start(self, total_layers: int) -> None: ...

    def step(self, message: str) -> None: ...

    def layer_done(self, index: int, errors: dict[str, float]) -> None: ...


class _Silent:
    def start(self, total_layers):
        pass

    def step(self, message):
        pass

    def layer_done(self, index, errors):
        pass


def quantize_layers(
    model: nn.Module,
    config: WeightQuantConfig,
    driver: LayerDriver,
    tokens: torch.Tensor | None,
    sink: Callable[[str, QuantizedWeight], None],
    *,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    source: LayerSource | None = None,
    offload_dir: Path | None = None,
    routed: dict[str, int] | None = None,
    checkpoints: LayerCheckpoints | None = None,
) -> dict[str, float]:
    """Quantize every decoder-layer linear of ``model`` in place (weights replaced by their dequantized values) and
    hand each ``QuantizedWeight`` to ``sink(full_name, weight)`` as soon as its layer is done. Returns each linear's
    error as its driver measured it, by full name.

    tokens: LongTensor [samples, seq_len] of calibration data; ``None`` for methods that need no activations.
    source: loads and releases each layer's weights (default: ``InMemory``, the model holds them all).
    offload_dir: an existing, empty directory (the caller makes and removes it) that holds the activations between
    layers instead of memory.
    routed: filled, for a Mixture-of-Experts model, with the calibration tokens routed to each expert (full module
    name → count).
    checkpoints: where each finished layer is saved, and where a layer saved by an earlier run of the same key is
    loaded from instead of being quantized again (``toolkit.engine.resume``); it still runs forward for the next.
    """
    scratch = None if offload_dir is None else Path(offload_dir)
    progress = progress or _Silent()
    source = source or InMemory()
    layers = decoder_layers(model)
    prefix = arch_spec(model).layers
    config, _ = config.fitted(input_widths(model, config))  # a group size given is checked, an unset one chosen
    inputs = None
    if config.needs_activations:
        if tokens is None:
            raise ValueError(f"method {config.method!r} needs calibration tokens")
        progress.step("capturing first-layer inputs")
        store = None if scratch is None else DiskActivations(scratch / "embeddings")
        inputs = capture_layer_inputs(model, tokens, batch_size, device, store)
    progress.start(len(layers))
    traced: dict[frozenset[str], tuple[list[list[str]], dict[str, tuple[str, int]]]] = {}  # per layer structure
    errors: dict[str, float] = {}
    for index, layer in enumerate(layers):
        source.load(index, layer)
        check_finite_weights(((f"{prefix}.{index}.{n}", p) for n, p in layer.named_parameters()), prefix)
        layer.to(device)
        linears = {n: m for n, m in layer_linears(layer).items() if not _skipped(f"{prefix}.{index}.{n}", config)}
        session = LayerSession(index, layer, inputs, config, linears, arch=arch_spec(model))
        everyone = config.moe_calibration == "all"
        saved = None if checkpoints is None else checkpoints.load(index)
        if inputs is not None and config.follows_float_model:  # the float stream, while the weights are float
            session.float_outputs(None if scratch is None else DiskActivations(scratch / f"reference-{index}"))
        counts: dict[str, int] = {}
        if saved is not None:
            progress.step(f"layer {index}: loaded from {checkpoints.directory}")
            saved.restore(layer)
            session.errors, counts = saved.errors, saved.routed
        elif inputs is not None:
            structure = frozenset(layer_linears(layer))  # dense and sparse layers of one MoE model differ
            if structure not in traced:
                traced[structure] = session.trace_input_groups(), session.trace_replayable()
            groups, replayable = traced[structure]
            session.groups = [kept for g in groups if (kept := [n for n in g if n in linears])]
            session.replayable = {n: r for n, r in replayable.items() if n in linears and not everyone}
            counts = session.routed_tokens()
            session.sparse = {n for n in linears if not everyone and _expert(n) in counts
                              and counts[_expert(n)] < max(config.moe_min_tokens, 1)}
        if routed is not None:
            routed.update({f"{prefix}.{index}.{e}": c for e, c in counts.items()})
        with torch.no_grad():
            if saved is not None:
                results = saved.weights
            else:
                with every_token(layer, everyone), weighing_rows(layer, session.arch.experts):
                    results = driver(session)
            for name, qweight in results.items():
                _check_finite_scales(qweight, f"{prefix}.{index}.{name}", config)
                linear = linears[name]
                linear.weight.copy_(qweight.dequantize().to(linear.weight.dtype))
                sink(f"{prefix}.{index}.{name}", qweight)
            if checkpoints is not None and saved is None:
                checkpoints.save(index, layer, results, session.errors, counts)
            if inputs is not None:
                store = None if scratch is None else DiskActivations(scratch / f"layer-{index}")
                outputs = session.forward(store)
                if isinstance(inputs.hidden, DiskActivations):
                    inputs.hidden.delete()
                inputs.hidden = outputs
                if config.follows_float_model:
                    if isinstance(inputs.reference, DiskActivations):
                        inputs.reference.delete()
                    inputs.reference = session.float_outputs()
        layer.to("cpu")
        source.release(index, layer)
        errors.update({f"{prefix}.{index}.{name}": e for name, e in session.errors.items()})
        progress.layer_done(index, session.errors)
        trim_heap()  # the layer's freed activations would otherwise stay resident, and the peak creep layer by layer
    return errors


def check_finite_weights(tensors: Iterable[tuple[str, torch.Tensor]], layers: str) -> None:
    """Refuse NaN or infinite weights before anything is quantized or written, naming the tensor (by full name) and
    its decoder layer (``layers``: the architecture's layer path, ``model.layers``); tensors not loaded yet (on the
    meta device) are skipped."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not tensor.is_meta and not all_finite(tensor):
            index = name.removeprefix(layers + ".").split(".")[0] if name.startswith(layers + ".") else None
            where = "outside the decoder layers" if index is None else f"decoder layer {index}"
            raise NonFiniteError(f"non-finite weights: {name} ({where}) holds NaN or infinite values, which no "
                                 f"quantizer can round; repair or re-export the model given to --model")


def _check_finite_scales(qweight: QuantizedWeight, name: str, config: WeightQuantConfig) -> None:
    """Refuse the NaN or infinite scales a method computed from finite weights (its statistics overflowed)."""
    if not all_finite(qweight.scale):
        raise NonFiniteError(f"non-finite scales: {config.method} computed NaN or infinite scales for {name} from "
                             f"finite weights; its statistics overflowed (try another --method or --dataset)")


def input_widths(model: nn.Module, config: WeightQuantConfig) -> dict[str, int]:
    """Full name → input width of every linear ``config`` quantizes (a meta-device skeleton is enough)."""
    prefix = arch_spec(model).layers
    return {f"{prefix}.{index}.{name}": linear.in_features for index, layer in enumerate(decoder_layers(model))
            for name, linear in layer_linears(layer).items() if not _skipped(f"{prefix}.{index}.{name}", config)}


def _expert(linear: str) -> str:
    """The expert module of an expert's linear (``mlp.experts.3.w1`` → ``mlp.experts.3``), else the name itself."""
    return linear.rsplit(".", 1)[0] if expert_index(linear) is not None else linear


def _skipped(full_name: str, config: WeightQuantConfig) -> bool:
    return any(full_name == s or full_name.endswith("." + s) for s in config.skip)
