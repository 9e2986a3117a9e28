"""SignRound layer driver: the rounding of every linear of a decoder layer learned on the layer's output.

Steps for one decoder layer (the math is ``toolkit.quant.signround``):
  1. The targets: the float model's outputs of the layer (``LayerSession.float_outputs``: the float layer on the float
     model's own inputs, which the engine carries beside the quantized ones).
  2. Learn V, α, β of all the layer's linears at once (``optimize``): each iteration runs the layer on one batch with
     the fake-quantized weights in place of its linears' (``torch.func.functional_call``, the module untouched) and
     takes the squared error to that batch's target, relative to round-to-nearest's on the same batch (step 3's
     first measure). The sign of the gradient is that of the mean squared error AutoRound takes; the best iterate is
     chosen on this relative loss because batches differ: an easy batch drawn first would otherwise hold the best
     loss that no later batch reaches (SmolLM2-135M, 20 iterations on batches of 2 sequences: with the plain loss its
     layer 2 kept round-to-nearest's codes).
  While learning, the layer runs under bfloat16 autocast (``train_dtype``, AutoRound's CPU default too): 1.6× faster
  per iteration on SmolLM2-135M (AVX-512 BF16), the weights, the learned state and the loss in float32.
  3. Measure every batch's output error (in float32) with round-to-nearest's codes (V = 0, α = β = 1) before
     learning, and with the learned ones after: ``session.errors`` gets the ratio of their sums for every linear
     of the layer.

The layer learns on the engine's inputs, the outputs of the layers already quantized, towards the float model's
outputs (AutoRound's default, ``enable_quanted_input``): the rounding of each layer also makes up for the error the
layers before it left. Targets from the float layer on the quantized inputs instead leave that error to grow layer
by layer (SmolLM2-135M W4 g64, 50 iterations: KL to the float model 0.125 with them, 0.098 with the float model's,
AutoRound's own 0.106; BENCHMARKS.md, "Quality at the frontier"). Experts routed too few tokens
(``session.sparse``) are rounded to nearest and stay fixed while the others learn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from toolkit.engine.session import LayerSession
from toolkit.methods import driver
from toolkit.quant.configs import SignRoundConfig
from toolkit.quant.primitives import QuantizedWeight
from toolkit.quant.signround import History, Rounding, optimize

ERROR_MEASURE = "layer output error on the calibration data relative to round-to-nearest's"


@driver(SignRoundConfig, error_measure=ERROR_MEASURE)
def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]:
    """Learn the rounding of every linear of the session's layer; ``session.errors`` gets the layer's output error
    relative to round-to-nearest's, for each of its linears."""
    results = session.rtn_sparse()
    fit = fit_layer(session)
    biases = {name: session.linears[name].bias for name in fit.names}
    results.update(fit.rounding.quantized(biases))
    session.errors.update({name: fit.relative_error for name in fit.names})
    return results


@dataclass
class LayerFit:
    """A layer's learned rounding: ``rounding`` over the linears ``names``, the ``history`` of its iterations, and the
    layer's output error (summed squares over every calibration batch) with round-to-nearest's codes and with the
    learned ones (both 0 when no iteration ran: nothing was measured)."""

    names: list[str]
    rounding: Rounding
    history: History
    rtn_error: float = 0.0
    error: float = 0.0

    @property
    def relative_error(self) -> float:
        """The learned codes' output error over round-to-nearest's (1 when they are round-to-nearest's)."""
        return self.error / self.rtn_error if self.rtn_error > 0 else 1.0


def fit_layer(session: LayerSession) -> LayerFit:
    """Steps 1-3 of the module docstring for the session's linears outside ``session.sparse``."""
    cfg, layer = session.config, session.layer
    names = [name for name in session.linears if name not in session.sparse]
    rounding = Rounding({name: session.linears[name].weight for name in names}, cfg.bits, cfg.group_size, cfg.sym,
                        cfg.scale_rule)
    fit = LayerFit(names, rounding, History())
    if cfg.iters == 0 or not names:
        return fit
    if session.inputs is None:
        raise ValueError("SignRound needs calibration activations; pass calibration tokens to quantize_layers")
    hidden, kwargs = session.inputs.hidden, session.inputs.kwargs
    targets = session.float_outputs()  # 1.
    dtypes = {name: session.linears[name].weight.dtype for name in names}

    def squared_error(batch: int, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        replaced = {f"{name}.weight": w.to(dtypes[name]) for name, w in weights.items()}
        out = _output(functional_call(layer, replaced, (hidden[batch],), kwargs[batch]))
        return (out.float() - targets[batch].float()).square().sum()

    def batch_errors() -> list[float]:
        weights = rounding.weights()
        return [float(squared_error(b, weights)) for b in range(len(targets))]

    nearest = batch_errors()  # 3. (before any step: V = 0, α = β = 1)

    def relative_error(batch: int, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(hidden[batch].device.type, dtype=torch.bfloat16, enabled=cfg.train_dtype == "bfloat16"):
            return squared_error(batch, weights) / max(nearest[batch], torch.finfo(torch.float32).tiny)

    generator = torch.Generator().manual_seed(cfg.seed + session.index)
    fit.history = optimize(rounding, relative_error, len(targets), cfg.iters, cfg.rounding_lr, cfg.clipping_lr,
                           generator)  # 2.
    fit.rtn_error, fit.error = sum(nearest), sum(batch_errors())
    return fit


def _output(out) -> torch.Tensor:
    """A decoder layer's hidden states, whether it returns them bare or first in a tuple."""
    return out[0] if isinstance(out, tuple) else out
