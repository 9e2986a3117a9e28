"""The driver registry (toolkit/methods/__init__.py): each method's driver and error measure, by config class."""

from dataclasses import dataclass

import pytest

from toolkit import methods
from toolkit.methods import awq, awq_gptq, driver, driver_for, error_measure, gptq, rtn, signround
from toolkit.quant.configs import METHODS, RTNConfig


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_has_a_driver_and_an_error_measure(name):
    config = METHODS[name]()
    assert callable(driver_for(config)) and error_measure(config)


def test_each_method_is_driven_by_its_module():
    assert {name: driver_for(cls()) for name, cls in METHODS.items()} == {
        "rtn": rtn.quantize_layer, "gptq": gptq.quantize_layer, "awq": awq.quantize_layer,
        "awq+gptq": awq_gptq.quantize_layer, "signround": signround.quantize_layer,
    }
    assert {name: error_measure(cls()) for name, cls in METHODS.items()} == {
        "rtn": "relative weight error ‖Ŵ − W‖ / ‖W‖",
        "gptq": "Hessian-weighted squared error (GPTQ loss)",
        "awq": "relative output error on calibration activations",
        "awq+gptq": "Hessian-weighted squared error (GPTQ loss)",
        "signround": "layer output error on the calibration data relative to round-to-nearest's",
    }


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
