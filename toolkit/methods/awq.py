"""AWQ layer driver: scale each group of ``Family.awq_groups`` on its block output, fold, then clip and quantize.

Steps for one decoder layer (the math is ``toolkit.quant.awq``):
  1. Subsample the calibration sequences to at most ``max_tokens`` tokens (whole sequences, so attention still sees
     its context; chosen with ``seed`` and the layer index) and run the float layer once, keeping what every linear
     reads and the inputs of each multi-linear group's block (``self_attn``, ``mlp``).
  2. In the table's order, for each scaling group whose linears are all quantized: search α on the block output of
     the float layer (attention output for q/k/v, MLP output for gate/up, the linear's own output for o and down),
     then fold the scales into the preceding module and the group's input columns. Folding keeps the float layer's
     outputs, so the only activations that change are the group's own input, which is divided by s in place of a
     recollection. A linear→linear group whose widths differ (v→o under GQA) is skipped, as AutoAWQ does.
     An expert's rows weigh as much as its output does in the layer's (its routing weight; ``_capture``).
  3. Per linear: search the clipping range (not for q/k, whose error reaches the output through softmax(q·k), which
     a per-linear error does not measure; AutoAWQ skips them too), quantize, and record the relative output error.

Steps 1-2 are ``scale_layer``, which the AWQ+GPTQ driver (``toolkit.methods.awq_gptq``) shares; step 3 is AWQ's own.
The folded norms and rows stay in the model (they are float parameters the checkpoint writer saves).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch import nn

from toolkit.engine.session import LayerInputs, LayerSession
from toolkit.methods import driver
from toolkit.quant import awq
from toolkit.quant.configs import AWQConfig
from toolkit.quant.primitives import QuantizedWeight

# Linears left unclipped (AutoAWQ ``avoid_clipping``): matched on the last component of their path.
NO_CLIP = ("q_proj", "k_proj")


@driver(AWQConfig, error_measure="relative output error on calibration activations")
def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]:
    """Scale, clip and quantize every linear of the session's layer; report each one's relative output error."""
    cfg = session.config
    activations = scale_layer(session)

    # 3. Clip, quantize, measure (experts routed too few tokens: round to nearest).
    results = session.rtn_sparse()
    for name, linear in session.linears.items():
        if name in session.sparse:
            continue
        W = linear.weight.data.float()
        R = activations.tokens(name)
        clip = cfg.clip and name.rsplit(".", 1)[-1] not in NO_CLIP
        max_val = awq.search_clip(W, R, cfg.bits, cfg.group_size, cfg.sym, rule=cfg.scale_rule) if clip else None
        bias = None if linear.bias is None else linear.bias.data
        qweight = awq.quantize_awq(W, cfg.bits, cfg.group_size, cfg.sym, max_val, bias, cfg.scale_rule)
        W_hat = qweight.dequantize()
        session.errors[name] = awq.relative_output_error(R, W, W_hat)
        linear.weight.data.copy_(W_hat.to(linear.weight.dtype))
        results[name] = qweight
    return results


class LayerActivations:
    """What the linears of one layer read on the subsampled calibration tokens, float32: X [T, K] per distinct
    input, keyed by the first linear reading it (``reader``), and its ``gram_factor``, computed when first asked for."""

    def __init__(self, X: dict[str, torch.Tensor], reader: dict[str, str]):
        self.X = X
        self.reader = reader
        self._factors: dict[str, torch.Tensor] = {}

    def tokens(self, name: str) -> torch.Tensor:
        """The gram_factor [≤K, K] of what linear ``name`` reads."""
        key = self.reader[name]
        if key not in self._factors:
            self._factors[key] = awq.gram_factor(self.X[key])
        return self._factors[key]

    def divide(self, key: str, scales: torch.Tensor) -> None:
        """The input ``key`` after its producer's output was divided by ``scales`` [K]. A gram factor R already
        computed is divided too: R·diag(s)⁻¹ factors diag(s)⁻¹·XᵀX·diag(s)⁻¹ exactly."""
        self.X[key] = self.X[key] / scales
        if key in self._factors:
            self._factors[key] = self._factors[key] / scales


def scale_layer(session: LayerSession) -> LayerActivations:
    """Steps 1-2 of the module docstring: search each scaling group's scales and fold them into the float layer.
    Returns what every linear reads afterwards (the rescaled activations), for the quantizer that follows."""
    cfg, arch, layer = session.config, session.arch, session.layer
    if arch is None:
        raise ValueError("AWQ needs the layer's Family (session.arch); "
                         "run it through toolkit.engine.loop.quantize_layers")
    if session.inputs is None:
        raise ValueError("AWQ needs calibration activations; pass calibration tokens to quantize_layers")
    calib = dataclasses.replace(
        session, inputs=subsample_sequences(session.inputs, cfg.max_tokens, cfg.seed + session.index), errors={}
    )

    # 1. One float forward: each input group's tokens X [T, K], and the calls into each multi-linear block.
    reader = _input_readers(session)
    groups = expand_groups(arch.awq_groups, session.linears)
    blocks = {_block_name(names) for _, names in groups if len(names) > 1 and _quantized(session, names)}
    X, calls = _capture(calib, sorted(set(reader.values())), sorted(blocks))
    activations = LayerActivations(X, reader)

    # 2. Scaling groups, in order.
    for prev_name, names in groups:
        if not _quantized(session, names) or (len(names) == 1 and names[0] in session.sparse):
            continue  # a linear → linear group of an expert routed too few tokens has nothing to fit on
        linears = [session.linears[n] for n in names]
        if layer.get_submodule(prev_name).weight.shape[0] != linears[0].in_features:
            continue  # e.g. v_proj → o_proj under GQA: v's rows do not line up with o's input columns
        keys = {reader[n] for n in names}
        # experts read their own routed tokens: the group's input statistics are then those of the block's input
        x = activations.X[reader[names[0]]] if len(keys) == 1 else _block_input(calls[_block_name(names)])
        if len(names) == 1:
            R = activations.tokens(names[0])
            block = lambda ws, R=R: R @ ws[0].T  # noqa: E731 (K pseudo-tokens; bias cancels in the loss)
        else:
            block = _block_output(layer.get_submodule(_block_name(names)), linears, calls[_block_name(names)])
        found = awq.search_scale(
            [m.weight.data for m in linears], awq.activation_scale(x), block,
            cfg.bits, cfg.group_size, cfg.sym, cfg.grid, cfg.scale_rule,
        )
        fold_group(layer, prev_name, names, found.scales, arch.norm_offset)
        for key in keys:
            activations.divide(key, found.scales)
    return activations


def expand_groups(groups: tuple[tuple[str, tuple[str, ...]], ...],
                  linears: dict[str, nn.Module]) -> list[tuple[str, tuple[str, ...]]]:
    """``Family.awq_groups`` with ``*`` replaced by the expert indices present among ``linears``: a group whose
    preceding module is an expert's becomes one group per expert (up_proj → down_proj); one whose linears only are
    becomes one group over every expert (the post-attention norm → every expert's gate/up). Groups without ``*`` pass
    unchanged."""
    out = []
    for prev, names in groups:
        patterns = [n for n in names if "*" in n]
        if not patterns and "*" not in prev:
            out.append((prev, names))
            continue
        indices = sorted({m.group(1) for n in patterns for name in linears
                          if (m := re.fullmatch(re.escape(n).replace(r"\*", r"(\d+)"), name))}, key=int)
        if "*" in prev:
            out += [(prev.replace("*", i), tuple(n.replace("*", i) for n in names)) for i in indices]
        elif indices:
            out.append((prev, tuple(n.replace("*", i) for n in patterns for i in indices)
                        + tuple(n for n in names if "*" not in n)))
    return out


def _block_input(calls: list[tuple[tuple, dict]]) -> torch.Tensor:
    """What a block read over its captured calls, float32 [T, K]."""
    return torch.cat([args[0].reshape(-1, args[0].shape[-1]).float() for args, _ in calls])


def fold_group(layer: nn.Module, prev_name: str, names: tuple[str, ...], scales: torch.Tensor, norm_offset: float):
    """Divide the output of ``prev_name`` (a norm or a linear) by ``scales`` [K] and multiply the input columns of the
    linears ``names`` by them: the float layer computes the same function afterwards."""
    prev = layer.get_submodule(prev_name)
    s = scales.to(prev.weight.device)
    bias = getattr(prev, "bias", None)
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            old_bias = None if bias is None else bias.data
            weight, new_bias = awq.fold_scales_into_linear_rows(prev.weight.data, old_bias, s)
        else:  # a norm computing x̂·(offset + weight) (+ bias)
            weight = awq.fold_scales_into_norm(prev.weight.data, s, norm_offset)
            new_bias = None if bias is None else (bias.data.float() / s).to(bias.dtype)
        prev.weight.data.copy_(weight)
        if new_bias is not None:
            bias.data.copy_(new_bias)
        for name in names:
            linear = layer.get_submodule(name)
            linear.weight.data.copy_(awq.scale_input_columns(linear.weight.data, s))


def subsample_sequences(inputs: LayerInputs, max_tokens: int, seed: int) -> LayerInputs:
    """At most ``max_tokens`` tokens of whole calibration sequences (at least one), chosen with ``seed``; the keyword
    arguments of each batch (masks, position embeddings) are cut to the kept rows where they carry a batch dimension."""
    rows = [(b, r) for b, h in enumerate(inputs.hidden) for r in range(h.shape[0])]
    keep = max(1, max_tokens // inputs.hidden[0].shape[1])
    if keep >= len(rows):
        return inputs
    generator = torch.Generator().manual_seed(seed)
    chosen = sorted(rows[i] for i in torch.randperm(len(rows), generator=generator)[:keep].tolist())
    hidden, kwargs = [], []
    for b in sorted({b for b, _ in chosen}):
        index = torch.tensor([r for bb, r in chosen if bb == b], device=inputs.hidden[b].device)
        hidden.append(inputs.hidden[b].index_select(0, index))
        kwargs.append(_take_rows(inputs.kwargs[b], index, inputs.hidden[b].shape[0]))
    return LayerInputs(hidden, kwargs)


def _take_rows(value, index: torch.Tensor, batch: int):
    """``value`` with every tensor whose first dimension is the batch cut to ``index`` (recursing into containers)."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device)) if value.dim() and value.shape[0] == batch else value
    if isinstance(value, dict):
        return {k: _take_rows(v, index, batch) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, index, batch) for v in value)
    return value


def _quantized(session: LayerSession, names: tuple[str, ...]) -> bool:
    return all(n in session.linears for n in names)


def _block_name(names: tuple[str, ...]) -> str:
    """The module whose output a multi-linear group is judged on: the innermost module holding all its linears
    (self_attn, mlp; ``mlp.experts`` for every expert's gate/up)."""
    paths = [n.split(".")[:-1] for n in names]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if not common:
        raise ValueError(f"AWQ group {names} has no common parent module to evaluate; "
                         "fix awq_groups in toolkit.architectures")
    return ".".join(common)


def _input_readers(session: LayerSession) -> dict[str, str]:
    """Each linear → the first linear reading the same tensor (from the engine's traced groups)."""
    reader = {}
    for group in session.groups:
        for name in group:
            reader[name] = group[0]
    for name in session.linears:
        reader.setdefault(name, name)
    return reader


def _capture(
    session: LayerSession, linears: list[str], blocks: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[tuple, dict]]]]:
    """Inputs of ``linears`` as float32 [T, K] and the (args, kwargs) of every call into ``blocks``. An expert's rows
    are scaled by their routing weight (``LayerSession.row_weights``), so that its statistics, clip search and error
    weigh each token as the layer's output does."""
    seen: dict[str, list] = {name: [] for name in [*linears, *blocks]}

    def keep(name, args, kwargs):
        if name not in linears:
            seen[name].append((args, dict(kwargs)))
            return
        x, weights = args[0].reshape(-1, args[0].shape[-1]).float(), session.row_weights(name)
        seen[name].append(x if weights is None else x * weights.reshape(-1, 1).to(x))

    session.collect([*linears, *blocks], keep)
    X = {name: torch.cat(seen[name]) if seen[name]  # an expert may receive no token
         else torch.empty(0, session.linears[name].in_features) for name in linears}
    return X, {name: seen[name] for name in blocks}


def _block_output(
    module: nn.Module, linears: list[nn.Linear], calls: list[tuple[tuple, dict]]
) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """block(ws): ``module``'s output on the captured calls, flattened to [T, H], with ws in place of the linears'
    weights (restored afterwards)."""

    def block(weights: list[torch.Tensor]) -> torch.Tensor:
        saved = [m.weight.data for m in linears]
        try:
            for m, w in zip(linears, weights):
                m.weight.data = w.to(device=m.weight.device, dtype=m.weight.dtype)
            outs = [module(*args, **kwargs) for args, kwargs in calls]
        finally:
            for m, w in zip(linears, saved):
                m.weight.data = w
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        return torch.cat([o.reshape(-1, o.shape[-1]).float() for o in outs])

    return block
