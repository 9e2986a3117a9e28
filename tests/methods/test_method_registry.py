"""The driver registry (toolkit/methods/__init__.py): each method's driver and error measure, by config class."""

from dataclasses import dataclass

import pytest

from toolkit import methods
from toolkit.methods import driver, driver_for, error_measure, gptq, rtn
from toolkit.quant.configs import METHODS, RTNConfig


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_has_a_driver_and_an_error_measure(name):
    config = METHODS[name]()
    assert callable(driver_for(config)) and error_measure(config)


def test_each_method_is_driven_by_its_own_module():
    """Each registered method runs the driver of the module named after it (a registration on the wrong config
    class would hand its method another's driver), and the one that ends in GPTQ's solver reports GPTQ's loss."""
    for name, cls in METHODS.items():
        assert driver_for(cls()).__module__ == f"toolkit.methods.{name.replace('+', '_')}", name
    assert error_measure(METHODS["awq+gptq"]()) == error_measure(METHODS["gptq"]()) == gptq.ERROR_MEASURE
    assert len({error_measure(METHODS[name]()) for name in ("rtn", "gptq", "awq", "signround")}) == 4


def test_a_subclass_keeps_its_methods_driver_and_a_new_method_needs_its_own(monkeypatch):
    @dataclass(frozen=True)
    class CalibratedRTN(RTNConfig):
        needs_activations = True

    @dataclass(frozen=True)
    class NovelConfig(RTNConfig):
        method = "novel"

    assert driver_for(CalibratedRTN()) is rtn.quantize_layer
    with pytest.raises(ValueError,
                       match=r"no layer driver for method 'novel'; known: awq, awq\+gptq, gptq, rtn, signround"):
        driver_for(NovelConfig())
    monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))  # the registration below is this test's

    @driver(NovelConfig, error_measure="none")
    def quantize_layer(session):
        return {}

    assert driver_for(NovelConfig()) is quantize_layer and error_measure(NovelConfig()) == "none"
    with pytest.raises(ValueError, match="method 'novel' already has a layer driver"):
        driver(NovelConfig, error_measure="none")(quantize_layer)
