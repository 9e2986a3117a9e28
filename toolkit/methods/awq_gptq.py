"""AWQ+GPTQ layer driver: AWQ's activation-aware scales, then GPTQ's error-compensating rounding of the scaled weights.

The two fix different things. AWQ (arXiv 2306.00978 §3.2) moves each salient input channel's range from the
activations into the weights, where a group's grid then resolves it finely; GPTQ (arXiv 2210.17323) rounds a given
W so that W·Xᵀ, not W, stays close. Folding the scales leaves the float layer's function unchanged, so GPTQ simply
quantizes the folded layer: its Hessians are collected from the rescaled inputs X·diag(s)⁻¹ and its target is
W·diag(s), the weights whose salient columns AWQ enlarged.

Steps for one decoder layer:
  1. ``toolkit.methods.awq.scale_layer``: search and fold the scales of every AWQ scaling group (on at most
     ``max_tokens`` calibration tokens, judged with round-to-nearest as in AWQ).
  2. ``toolkit.methods.gptq.quantize_layer`` on the folded layer (every calibration token; true-sequential as
     configured). ``session.errors`` gets GPTQ's loss per linear.

AWQ's clip search is left out: clamping W before GPTQ changes the target GPTQ fits, and it made the combination worse
where measured (SmolLM2-135M W4 g64 asymmetric, held-out perplexity 27.95 with AWQ's clip against 26.93 without;
tiny salient-channel Llamas, layer-output error 0.12 against 0.09).
"""

from __future__ import annotations

from toolkit.engine.session import LayerSession
from toolkit.methods import awq, driver, gptq
from toolkit.quant.configs import AWQGPTQConfig
from toolkit.quant.primitives import QuantizedWeight


@driver(AWQGPTQConfig, error_measure=gptq.ERROR_MEASURE)
def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]:
    """Fold AWQ's scales into the session's layer, then quantize every linear with GPTQ."""
    awq.scale_layer(session)
    return gptq.quantize_layer(session)
