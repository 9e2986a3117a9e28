"""Method configs (toolkit/quant/configs.py): one name registry derived from the classes, capabilities that refuse
what a method cannot honour, and every user setting declared as an option with its help."""

from dataclasses import fields

import pytest

from toolkit.options import flag_of, help_of, option_fields
from toolkit.quant.configs import (
    METHODS,
    AWQConfig,
    AWQGPTQConfig,
    ConfigError,
    GPTQConfig,
    RTNConfig,
    SignRoundConfig,
    WeightQuantConfig,
    make_config,
    methods_that,
)


def test_methods_are_named_by_their_classes():
    assert METHODS == {"rtn": RTNConfig, "gptq": GPTQConfig, "awq": AWQConfig, "awq+gptq": AWQGPTQConfig,
                       "signround": SignRoundConfig}
    assert all(cls.method == name for name, cls in METHODS.items())
    assert methods_that("data_parallel") == ["rtn", "gptq"]
    assert methods_that("reorders_columns") == ["gptq", "awq+gptq"]


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_act_order_is_refused_where_columns_are_never_reordered(method):
    with pytest.raises(ConfigError, match=rf"act_order is a GPTQ option; method '{method}' has none "
                                          r"\(use gptq or awq\+gptq\)"):
        make_config(method, act_order=True)
    assert make_config(method, act_order=False).act_order is False


def test_defaults_stay_per_method_where_they_differ():
    assert (RTNConfig().act_order, AWQConfig().act_order) == (False, False)
    assert (GPTQConfig().act_order, AWQGPTQConfig().act_order) == (True, True)
    assert all(cls().static_groups for cls in METHODS.values())
    assert not any(cls().sym for cls in METHODS.values())  # one grid for every method: asymmetric, as measured
    assert GPTQConfig().mse_clip and AWQGPTQConfig().mse_clip


@pytest.mark.parametrize("cls", list(METHODS.values()), ids=list(METHODS))
def test_every_user_setting_is_an_option_with_help(cls):
    options = option_fields(cls)
    assert [f.name for f in options] == [f.name for f in fields(cls) if f.name != "version"]
    assert all(help_of(f) for f in options)
    flags = {f.name: flag_of(f) for f in options}
    assert (flags["sym"], flags["act_order"]) == ("--sym/--asym", "--act-order/--no-act-order")


def test_a_changed_default_keeps_the_options_help():
    base = {f.name: f for f in option_fields(WeightQuantConfig)}
    for cls, name in [(AWQConfig, "sym"), (AWQGPTQConfig, "sym"), (GPTQConfig, "act_order")]:
        declared = next(f for f in option_fields(cls) if f.name == name)
        assert (help_of(declared), flag_of(declared)) == (help_of(base[name]), flag_of(base[name]))
    awq = {f.name: f for f in option_fields(AWQConfig)}
    for f in option_fields(AWQGPTQConfig):
        if f.name in ("grid", "max_tokens"):
            assert (f.default, help_of(f)) == (awq[f.name].default, help_of(awq[f.name]))
