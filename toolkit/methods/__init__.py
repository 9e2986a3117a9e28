"""Per-layer drivers: each binds one method's math (``toolkit.quant``) to the engine's ``LayerSession``.

A driver is looked up by the config's ``method`` name; adding a method means adding a module here and registering
its config in ``toolkit.quant.configs``, never editing a dispatcher.
"""

from __future__ import annotations

from toolkit.engine.loop import LayerDriver
from toolkit.methods import awq
from toolkit.methods import awq_gptq
from toolkit.methods import gptq
from toolkit.methods import rtn

DRIVERS: dict[str, LayerDriver] = {
    "rtn": rtn.quantize_layer,
    "gptq": gptq.quantize_layer,
    "awq": awq.quantize_layer,
    "awq+gptq": awq_gptq.quantize_layer,
}

# What each driver records in ``session.errors`` per linear (comparable across layers of one run, not across methods).
ERROR_MEASURES: dict[str, str] = {
    "rtn": "relative weight error ‖Ŵ − W‖ / ‖W‖",
    "gptq": "GPTQ loss (Hessian-weighted squared error)",
    "awq": "relative output error on calibration activations",
    "awq+gptq": "GPTQ loss (Hessian-weighted squared error)",
}


def driver_for(method: str) -> LayerDriver:
    """The layer driver of a registered method."""
    try:
        return DRIVERS[method]
    except KeyError:
        raise ValueError(f"no layer driver for method {method!r}; known: {', '.join(sorted(DRIVERS))}") from None
