"""GPTQ layer driver: Hessians from what the layer's linears read on the calibration data, then
``toolkit.quant.gptq`` on each linear.

An expert's Hessian weighs each token by the square of the routing weight its output gets
(``LayerSession.row_weights``): the layer's output error on that token scales by it. Linears that read the same
tensor (q/k/v; gate/up) share one Hessian, accumulated and factored once (the Hessian is freed as soon as its factor
exists: at K = 8192 each K×K matrix is 268 MB). With ``true_sequential`` the groups are taken in execution order and
each group's Hessian is collected after the previous groups were quantized and written back, so o_proj is fitted to
the inputs the quantized q/k/v produce (as in the reference ``--true-sequential``); the inputs of o_proj and
down_proj are kept as they are collected, so the later passes and the engine's final forward take attention's and the
MLP's outputs from those linears alone (``LayerSession`` replay). Without it, one pass collects every Hessian from
the float layer. Under torchrun each rank accumulates over its share of the calibration batches and the Hessians are
averaged over ranks (weighted by tokens) before factoring, so every rank quantizes with the whole batch's Hessian.

``float_targets`` (GPTAQ's objective): before anything is rounded, the layer runs on the float model's inputs
(``LayerSession.float_linear_inputs``) and each group keeps what its linears read there; the Hessian pass then also
accumulates the correction D between those inputs and the quantized model's, and GPTQ fits W* =
``float_target_weights`` instead of W. Experts keep W: the float model routes other tokens to them.

``refit_rounds``: each linear's group scales are then refitted to its codes (``toolkit.quant.refit.alternate``, GPTQ
choosing the codes again on each refitted grid) against its group's dampened Hessian, kept beside the factor for it.
"""

from __future__ import annotations

import torch

from toolkit.engine.distributed import mean_over_ranks
from toolkit.engine.session import ActivationError, LayerSession
from toolkit.experts import expert_index
from toolkit.methods import driver
from toolkit.quant.configs import GPTQConfig
from toolkit.quant.finite import all_finite
from toolkit.quant.gptq import (CorrectionAccumulator, HessianAccumulator, HessianFactor, dampened_,
                                float_target_weights, gptq_factored, hessian_factor)
from toolkit.quant.primitives import QuantizedWeight
from toolkit.quant.refit import alternate

ERROR_MEASURE = "Hessian-weighted squared error (GPTQ loss)"  # what ``session.errors`` gets, here and in awq_gptq


@driver(GPTQConfig, error_measure=ERROR_MEASURE)
def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]:
    """Quantize every linear of the layer with GPTQ; ``session.errors`` gets each one's GPTQ loss. The linears of
    experts routed too few tokens (``session.sparse``) are rounded to nearest."""
    groups = [group for group in session.groups if not session.sparse.intersection(group)]
    missing = set(session.linears) - session.sparse - {name for group in groups for name in group}
    if missing:
        raise RuntimeError(
            f"linears {', '.join(sorted(missing))} of decoder layer {session.index} never ran on the calibration "
            f"data, so GPTQ has no Hessian for them; add them to skip"
        )
    cfg = session.config
    # before any weight is rounded: what each group reads in the float model (experts: routed differently there)
    float_inputs = session.float_linear_inputs(g[0] for g in groups if expert_index(g[0]) is None) \
        if cfg.float_targets else {}
    results = session.rtn_sparse()
    hessians, corrections = ({}, {}) if cfg.true_sequential else _hessians(session, groups, float_inputs)
    for group in groups:
        if cfg.true_sequential:
            # everything before this group is final, so its replayable inputs can be kept for the later passes
            hessians, corrections = _hessians(session, [group], float_inputs, keep=True)
            float_inputs.pop(group[0], None)  # read once
        correction = corrections.get(group[0])
        targets = {} if correction is None else {
            name: float_target_weights(session.linears[name].weight.data, correction, hessians[group[0]], cfg.damp)
            for name in group}
        # kept for the refits only: otherwise popped straight into the call, so that the factorization holds the
        # only reference and frees the Hessian
        hessian = hessians[group[0]] if cfg.refit_rounds else None
        factor = hessian_factor(hessians.pop(group[0]), cfg.damp, cfg.act_order)
        if hessian is not None:
            dampened_(hessian, cfg.damp)
        results.update({name: _quantize_linear(session, name, factor, targets.get(name), hessian) for name in group})
        del factor, hessian
    return results


def _hessians(session: LayerSession, groups: list[list[str]], float_inputs: dict[str, list[torch.Tensor]],
              keep: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One Hessian [K, K] per group of linears sharing an input, keyed by the group's first linear, in one pass
    (``keep``: as ``LayerSession.collect_linear_inputs``); and for each group in ``float_inputs`` (the float model's
    inputs of its linears, per batch) the correction D of ``CorrectionAccumulator``."""
    accumulators, correcting, batches = {}, {}, {}
    for group in groups:
        weight = session.linears[group[0]].weight
        accumulators[group[0]] = HessianAccumulator(weight.shape[1], device=weight.device)
        if group[0] in float_inputs:
            correcting[group[0]] = CorrectionAccumulator(weight.shape[1], device=weight.device)
            batches[group[0]] = 0

    def on_input(name: str, X: torch.Tensor) -> None:
        if not all_finite(X):
            raise ActivationError(
                f"NaN or infinite activations entering {name} of decoder layer {session.index}; the model or its "
                f"dtype overflows on the calibration data (try --dtype float32, or check the checkpoint)"
            )
        accumulators[name].add(X, session.row_weights(name))
        if name in correcting:  # each linear runs once per batch, so its calls count the batches
            correcting[name].add(float_inputs[name][batches[name]], X)
            batches[name] += 1

    session.collect_linear_inputs(accumulators, on_input, keep=keep)
    corrections = {name: mean_over_ranks(acc.D, acc.tokens)[0] for name, acc in correcting.items()}
    hessians = {}
    for name, acc in accumulators.items():
        # under torchrun each rank saw its share of the batches
        hessians[name], tokens = mean_over_ranks(acc.H, acc.tokens)
        if tokens == 0:
            raise RuntimeError(f"{name} of decoder layer {session.index} saw no calibration tokens")
        if not all_finite(hessians[name]):  # finite inputs whose products overflow float32
            raise ActivationError(f"the Hessian of {name} in decoder layer {session.index} is NaN or infinite: its "
                                  f"calibration activations overflow float32 (check the model or the --dataset)")
    return hessians, corrections


def _quantize_linear(session: LayerSession, name: str, factor: HessianFactor, target: torch.Tensor | None = None,
                     hessian: torch.Tensor | None = None) -> QuantizedWeight:
    """GPTQ one linear towards ``target`` (default: its weight), with ``refit_rounds`` against the dampened
    ``hessian``; write its dequantized weight back at once (later groups must see it), record its loss."""
    cfg = session.config
    linear = session.linears[name]
    W = linear.weight.data if target is None else target
    qweight, loss = gptq_factored(W, factor, cfg.bits, cfg.group_size, cfg.sym, block_size=cfg.block_size,
                                  static_groups=cfg.static_groups, mse_clip=cfg.mse_clip, rule=cfg.scale_rule)
    if cfg.refit_rounds:
        W = W.float().masked_fill(factor.dead, 0.0)  # as GPTQ fits it: inputs never active get a zero weight

        def on_grid(grid: QuantizedWeight) -> QuantizedWeight:
            return gptq_factored(W, factor, cfg.bits, cfg.group_size, cfg.sym, block_size=cfg.block_size,
                                 rule=cfg.scale_rule, grid=grid)[0]

        qweight, loss = alternate(qweight, W, hessian, cfg.refit_rounds - 1, on_grid, cfg.scale_rule)
    qweight.bias = linear.bias
    linear.weight.data.copy_(qweight.dequantize().to(linear.weight.dtype))
    session.errors[name] = loss
    return qweight
