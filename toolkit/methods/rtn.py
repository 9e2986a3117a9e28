"""Round-to-nearest: each linear's weights alone, no calibration data."""

from __future__ import annotations

from toolkit.engine.session import LayerSession
from toolkit.methods import driver
from toolkit.quant.configs import RTNConfig
from toolkit.quant.primitives import QuantizedWeight, quantize_rtn


@driver(RTNConfig, error_measure="relative weight error ‖Ŵ − W‖ / ‖W‖")
def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]:
    """Quantize every linear of the layer to the nearest grid point; report the relative weight error."""
    cfg = session.config
    results = {}
    for name, linear in session.linears.items():
        W = linear.weight.data.float()
        qweight = quantize_rtn(W, cfg.bits, cfg.group_size, cfg.sym, linear.bias, cfg.scale_rule)
        session.errors[name] = float((qweight.dequantize() - W).norm() / W.norm().clamp_min(1e-12))
        results[name] = qweight
    return results
