"""Per-layer drivers: each binds one method's math (``toolkit.quant``) to the engine's ``LayerSession``.

Each driver module registers its driver once, for its config class, with what the driver records in
``session.errors`` per linear (comparable across layers of one run, not across methods):

    @driver(GPTQConfig, error_measure="Hessian-weighted squared error (GPTQ loss)")
    def quantize_layer(session: LayerSession) -> dict[str, QuantizedWeight]: ...

``driver_for`` and ``error_measure`` look a config up by its class. Adding a method means a config class in
``toolkit.quant.configs`` and a module here (imported at the end of this file), never editing a dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from toolkit.engine.loop import LayerDriver
from toolkit.quant.configs import WeightQuantConfig


@dataclass(frozen=True)
class _Registration:
    quantize_layer: LayerDriver
    error_measure: str


_REGISTRY: dict[type[WeightQuantConfig], _Registration] = {}


def driver(config_class: type[WeightQuantConfig], *, error_measure: str) -> Callable[[LayerDriver], LayerDriver]:
    """Decorator: register the decorated function as the layer driver of ``config_class``, whose per-linear
    ``session.errors`` are ``error_measure``."""

    def register(quantize_layer: LayerDriver) -> LayerDriver:
        if config_class in _REGISTRY:
            raise ValueError(f"method {config_class.method!r} already has a layer driver")
        _REGISTRY[config_class] = _Registration(quantize_layer, error_measure)
        return quantize_layer

    return register


def _registration(config: WeightQuantConfig) -> _Registration:
    """The registration of ``config``'s method: its class's, or that of the nearest base naming the same method (a
    subclass that changes only capabilities keeps the driver; one that names a new method needs its own)."""
    for cls in type(config).__mro__:
        if cls in _REGISTRY and cls.method == config.method:
            return _REGISTRY[cls]
    known = ", ".join(sorted(cls.method for cls in _REGISTRY))
    raise ValueError(f"no layer driver for method {config.method!r}; known: {known}")


def driver_for(config: WeightQuantConfig) -> LayerDriver:
    """The layer driver of ``config``'s method."""
    return _registration(config).quantize_layer


def error_measure(config: WeightQuantConfig) -> str:
    """What ``config``'s driver records in ``session.errors`` per linear."""
    return _registration(config).error_measure


# Last, because each driver module registers itself with ``driver`` above when imported.
from toolkit.methods import awq, awq_gptq, gptq, rtn, signround  # noqa: E402,F401
