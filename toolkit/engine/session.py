"""A decoder layer's calibration inputs and the session a method's driver quantizes it in.

``capture_layer_inputs`` runs the model up to its first decoder layer and keeps what that layer receives
(``LayerInputs``); a ``LayerSession`` holds one layer with those inputs and runs it under hooks, so that a driver
sees what each linear reads (``collect``, ``collect_linear_inputs``) and the next layer gets its inputs
(``forward``). The loop over layers is ``toolkit.engine.loop``.

Replay: a linear whose output is its parent module's whole output (o_proj of the attention block, down_proj of the
MLP) can stand in for that parent. A driver that quantizes in execution order (GPTQ, true-sequential) keeps such a
linear's inputs once everything before it is final (``collect_linear_inputs(..., keep=True)``); later passes and
the final forward then take the parent's output from that one linear, computed once per batch on the kept input
(which is then dropped), instead of recomputing attention or the MLP. Same numbers, a fraction of the work. The
final forward also drops each batch's inputs as soon as its output exists, so the kept tensors cost little peak
memory.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toolkit.architectures import Family
from toolkit.engine.offload import DiskActivations
from toolkit.experts import ExpertLinears, every_token, expert_index
from toolkit.models import arch_spec, decoder_layers, layer_linears
from toolkit.quant.configs import WeightQuantConfig
from toolkit.quant.finite import NonFiniteError, all_finite
from toolkit.quant.primitives import QuantizedWeight, quantize_rtn


class ActivationError(NonFiniteError):
    """Calibration activations that no quantizer can use (NaN or infinite values)."""


class _Stop(Exception):
    """Raised inside a hook to end a forward early, once everything asked for was seen."""


@dataclass
class LayerInputs:
    """What enters one decoder layer for every calibration batch: hidden states [B, T, H] (a list, or a
    ``DiskActivations`` read back batch by batch) and keyword arguments. ``reference``: what the float model's same
    layer receives, for methods that learn on the float model's outputs (``learns_rounding``); None where it equals
    ``hidden`` (the first layer) or is not kept."""

    hidden: Sequence[torch.Tensor]
    kwargs: list[dict[str, Any]]
    reference: Sequence[torch.Tensor] | None = None


@dataclass
class LayerSession:
    """One decoder layer, its calibration inputs, and the means to run it under hooks.

    ``groups``: the linears grouped by shared input in execution order (traced once, on the first layer).
    ``errors`` collects one number per linear (the driver's own measure of quantization error) for the report.
    ``replayable``: linear name → (parent module name, the parent's output arity: 0 for the bare tensor, n for a
    tuple whose first item is the linear's output and the rest None); traced once, like ``groups``.
    ``sparse``: the linears of experts routed too few calibration tokens for statistics; drivers round them to
    nearest (``rtn_sparse``).
    """

    index: int
    layer: nn.Module
    inputs: LayerInputs | None
    config: WeightQuantConfig
    linears: dict[str, nn.Linear]
    groups: list[list[str]] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    arch: Family | None = None
    replayable: dict[str, tuple[str, int]] = field(default_factory=dict)
    kept: dict[str, _Kept] = field(default_factory=dict, repr=False)
    sparse: set[str] = field(default_factory=set)
    _float_outputs: Sequence[torch.Tensor] | None = field(default=None, repr=False)

    def float_outputs(self, store: DiskActivations | None = None) -> Sequence[torch.Tensor]:
        """The float model's outputs of this layer for every calibration batch: the layer run on the float model's
        inputs (``inputs.reference``, else the session's own), computed on the first call, while the weights are
        still float, and kept (appended to ``store``, default a list). A learner's targets, and the next layer's
        ``reference``."""
        if self._float_outputs is None:
            hidden = self.inputs.reference if self.inputs.reference is not None else self.inputs.hidden
            outputs = [] if store is None else store
            with torch.no_grad():
                for b, kwargs in enumerate(self.inputs.kwargs):
                    out = _layer_output(self.layer(hidden[b], **kwargs))
                    _check_finite([out], self.index)
                    outputs.append(out)
            self._float_outputs = outputs
        return self._float_outputs

    def float_linear_inputs(self, names: Iterable[str]) -> dict[str, list[torch.Tensor]]:
        """What each named linear reads in the float model, per calibration batch, flattened to [tokens, in_features]:
        the layer as it is now (call it before any weight is rounded) run on the float model's inputs (as
        ``float_outputs``). Each linear must run once per forward (not an expert's)."""
        names = list(names)
        hidden = self.inputs.reference if self.inputs.reference is not None else self.inputs.hidden
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}

        def make_hook(name):
            def hook(module, args):
                seen[name].append(args[0].reshape(-1, args[0].shape[-1]))
            return hook

        handles = [self.layer.get_submodule(n).register_forward_pre_hook(make_hook(n)) for n in names]
        try:
            with torch.no_grad():
                for b, kwargs in enumerate(self.inputs.kwargs):
                    self.layer(hidden[b], **kwargs)
        finally:
            for h in handles:
                h.remove()
        twice = [name for name, xs in seen.items() if len(xs) != len(self.inputs.kwargs)]
        if twice:
            raise RuntimeError(f"{', '.join(twice)} of decoder layer {self.index} did not run once per batch")
        return seen

    def rtn_sparse(self) -> dict[str, QuantizedWeight]:
        """Round the ``sparse`` linears to nearest, write their weights back, and return them."""
        cfg, results = self.config, {}
        for name in sorted(self.sparse):
            linear = self.linears[name]
            results[name] = quantize_rtn(linear.weight.data, cfg.bits, cfg.group_size, cfg.sym, linear.bias,
                                         cfg.scale_rule)
            linear.weight.data.copy_(results[name].dequantize().to(linear.weight.dtype))
        return results

    def routed_tokens(self) -> dict[str, int]:
        """Calibration tokens routed to each expert of the layer (``ExpertLinears`` path + ``.`` + index → count),
        from the routing the experts modules receive (the experts themselves are not run)."""
        blocks = {n: m for n, m in self.layer.named_modules() if isinstance(m, ExpertLinears)}
        counts = {n: torch.zeros(len(m), dtype=torch.long) for n, m in blocks.items()}

        def seen(name, args, kwargs):
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts[name] += torch.bincount(top_k_index.flatten().cpu(), minlength=len(blocks[name]))[:len(blocks[name])]

        if blocks:
            self.collect(blocks, seen)
        return {f"{n}.{e}": int(c) for n, block in counts.items() for e, c in enumerate(block.tolist())}

    def row_weights(self, linear: str) -> torch.Tensor | None:
        """The routing weight of each row an expert's linear just read (``toolkit.experts.weighing_rows``, active
        while the driver runs), None for a linear outside the experts."""
        if expert_index(linear) is None:
            return None
        weights = self.layer.get_submodule(linear.rpartition(".")[0]).row_weights
        if weights is None:
            raise RuntimeError(f"{linear} of decoder layer {self.index} ran with no routing weights recorded: its "
                               "statistics must come from a forward of the whole layer while the driver runs")
        return weights

    def collect(
        self,
        names: Iterable[str],
        on_input: Callable[[str, tuple, dict], None],
        stop: bool = True,
        batches: int | None = None,
    ) -> None:
        """Run the calibration batches (all, or the first ``batches``) through the layer, calling
        ``on_input(name, args, kwargs)`` as each named submodule is entered; with ``stop``, each batch ends as soon
        as all named submodules were seen."""
        names = list(names)
        if self.inputs is None:
            raise RuntimeError(f"method {self.config.method!r} needs calibration activations")
        pending: set[str] = set()

        def make_hook(name):
            def hook(module, args, kwargs):
                on_input(name, args, kwargs)
                pending.discard(name)
                if stop and not pending:
                    raise _Stop
            return hook

        handles = [
            self.layer.get_submodule(n).register_forward_pre_hook(make_hook(n), with_kwargs=True) for n in names
        ]
        try:
            with self._replaying() as batch_index:
                for b, (hidden, kwargs) in enumerate(itertools.islice(zip(self.inputs.hidden, self.inputs.kwargs),
                                                                       batches)):
                    batch_index[0] = b
                    pending.update(names)
                    try:
                        self.layer(hidden, **kwargs)
                    except _Stop:
                        pass
        finally:
            for h in handles:
                h.remove()

    def collect_linear_inputs(
        self, names: Iterable[str], on_input: Callable[[str, torch.Tensor], None], keep: bool = False
    ) -> None:
        """Like ``collect`` for linears: ``on_input(name, X)`` with X flattened to [tokens, in_features].

        keep: also keep, per batch, the inputs of the replayable linears among ``names``, so that later passes take
        their parents' outputs from those linears alone (computed once, then reused). Only valid while nothing
        that runs up to and including them changes: the caller promises that the layer's weights up to these
        linears are final by the next pass. Ignored for activations on disk."""
        names = list(names)
        keeping = [n for n in names if keep and n in self.replayable and isinstance(self.inputs.hidden, list)]
        fresh: dict[str, list[torch.Tensor]] = {n: [] for n in keeping}

        def seen(name, args, kwargs):
            if name in fresh:
                fresh[name].append(args[0])
            on_input(name, args[0].reshape(-1, args[0].shape[-1]))

        self.collect(names, seen)
        # a linear run more than once per forward cannot stand in for its parent
        self.kept.update({n: _Kept(self.inputs, xs) for n, xs in fresh.items() if len(xs) == len(self.inputs.hidden)})

    @contextlib.contextmanager
    def _replaying(self):
        """While active, each parent of a kept linear returns that linear's output on the current batch's kept
        input (the batch index is the yielded one-item list, set by the caller)."""
        batch_index = [0]
        patched = []
        for name, kept in self.kept.items():
            if kept.inputs is not self.inputs:  # kept for other inputs (a session copied onto a subsample)
                continue
            parent_name, arity = self.replayable[name]
            parent, linear = self.layer.get_submodule(parent_name), self.layer.get_submodule(name)

            def stand_in(*args, _linear=linear, _kept=kept, _arity=arity, **kwargs):
                out = _kept.output(batch_index[0], _linear)
                return (out, *[None] * (_arity - 1)) if _arity else out

            parent.forward = stand_in
            patched.append(parent)
        try:
            yield batch_index
        finally:
            for parent in patched:
                del parent.forward

    def forward(self, store: DiskActivations | None = None) -> Sequence[torch.Tensor]:
        """Outputs of the layer (as it is now) for every calibration batch, appended to ``store`` (default: a new
        list); NaN or infinite outputs are refused. The session's last step: each batch's inputs held in memory
        (hidden states, kept inputs) are dropped once its output exists."""
        outputs = [] if store is None else store
        with self._replaying() as batch_index:
            for b, kwargs in enumerate(self.inputs.kwargs):
                batch_index[0] = b
                out = _layer_output(self.layer(self.inputs.hidden[b], **kwargs))
                _check_finite([out], self.index)
                outputs.append(out)
                if isinstance(self.inputs.hidden, list):
                    self.inputs.hidden[b] = None
                for kept in self.kept.values():
                    kept.drop(b)
        self.kept.clear()
        return outputs

    def trace_input_groups(self) -> list[list[str]]:
        """Linears grouped by the tensor they read, in execution order: [[q, k, v], [o], [gate, up], [down]] for
        a Llama layer. Traced on the first batch, so it follows the real forward of any architecture."""
        order: list[tuple[str, torch.Tensor]] = []  # the inputs themselves: an id() could be reused once one is freed
        names = list(layer_linears(self.layer))
        with every_token(self.layer):  # every expert runs, each on an input of its own
            self.collect(names, lambda name, args, kwargs: order.append((name, args[0])), batches=1)
        groups: list[list[str]] = []
        last_input = None
        for name, tensor in order:
            if groups and tensor is last_input:
                groups[-1].append(name)
            else:
                groups.append([name])
            last_input = tensor
        return groups

    def trace_replayable(self) -> dict[str, tuple[str, int]]:
        """The linears that can stand in for their parent module (see ``replayable``), found by running the first
        batch through the whole layer and comparing each parent's output with its linears' outputs."""
        outputs: dict[str, Any] = {}
        linears = layer_linears(self.layer)
        parents = {n.rpartition(".")[0] for n in linears} - {""}
        handles = [
            self.layer.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: outputs.setdefault(n, out))
            for n in [*linears, *parents]
        ]
        try:
            with torch.no_grad(), every_token(self.layer):
                self.layer(self.inputs.hidden[0], **self.inputs.kwargs[0])
        finally:
            for h in handles:
                h.remove()
        found = {}
        for name in linears:
            parent = name.rpartition(".")[0]
            mine, theirs = outputs.get(name), outputs.get(parent)
            if parent and mine is not None and theirs is mine:
                found[name] = (parent, 0)
            elif (parent and isinstance(theirs, tuple) and theirs and theirs[0] is mine and mine is not None
                  and all(x is None for x in theirs[1:])):
                found[name] = (parent, len(theirs))
        return found


@dataclass
class _Kept:
    """A replayable linear's inputs, per batch, for the ``inputs`` they were collected on; each batch's output once
    computed (the linear's weights are final by then), which replaces its input."""

    inputs: LayerInputs
    tensors: list[torch.Tensor | None]
    computed: set[int] = field(default_factory=set)

    def output(self, batch: int, linear: nn.Module) -> torch.Tensor:
        """``linear`` on batch ``batch``'s kept input, computed on first use."""
        if batch not in self.computed:
            self.tensors[batch] = linear(self.tensors[batch])
            self.computed.add(batch)
        return self.tensors[batch]

    def drop(self, batch: int) -> None:
        self.tensors[batch] = None


def capture_layer_inputs(
    model: nn.Module,
    tokens: torch.Tensor,
    batch_size: int,
    device: torch.device | str = "cpu",
    store: DiskActivations | None = None,
) -> LayerInputs:
    """Run the model up to its first decoder layer for each batch of ``tokens`` and keep what that layer receives
    (hidden states appended to ``store``, default a list). Only the modules outside the decoder layers (and the LM
    head) move to ``device``, and back to the CPU afterwards: the layers may have no weights yet."""
    first = decoder_layers(model)[0]
    hidden, kwargs = ([] if store is None else store), []

    def grab(module, args, kw):
        hidden.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.append({k: v for k, v in kw.items() if k not in ("cache", "past_key_values", "past_key_value", "use_cache")})
        raise _Stop

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    outside = list(_outside_layers(model, arch_spec(model).layers.split(".")))
    for m in outside:
        m.to(device)
    try:
        with torch.no_grad():
            for batch in tokens.split(batch_size):
                try:
                    model(input_ids=batch.to(device), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
        if torch.device(device).type != "cpu":  # back beside the layers: KV calibration and the writer read them there
            for m in outside:
                m.to("cpu")
    _check_finite(hidden, -1)
    return LayerInputs(hidden, kwargs)


def _outside_layers(module: nn.Module, path: list[str]) -> Iterable[nn.Module]:
    """The children of ``module`` that neither hold the decoder layers at ``path`` nor are the LM head, descending
    into the modules along ``path`` (``model.layers``: ``model.embed_tokens``, ``model.norm``, ``model.rotary_emb``)."""
    for name, child in module.named_children():
        if name == path[0]:
            if len(path) > 1:
                yield from _outside_layers(child, path[1:])
        elif name != "lm_head":
            yield child


def _layer_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _check_finite(tensors: list[torch.Tensor], index: int) -> None:
    for t in tensors:
        if not all_finite(t):
            where = "the embeddings" if index < 0 else f"decoder layer {index}"
            raise ActivationError(
                f"NaN or infinite activations after {where}; the model or its dtype overflows on the calibration "
                f"data (try --dtype float32, or check the checkpoint)"
            )
