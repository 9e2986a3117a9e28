"""The format registry (toolkit/formats/__init__.py): every format reads back the numbers its quantization_config
declares, refuses the variants compound cannot decode, and ``auto`` picks the documented layout."""

import json

import pytest

from toolkit.formats import FORMATS, FormatError, awq, choose_format, compressed_tensors, gptq, read_quantization_config
from toolkit.quant.configs import AWQConfig, ConfigError, GPTQConfig, RTNConfig

CONFIGS = [
    RTNConfig(bits=4, group_size=128, sym=True),
    RTNConfig(bits=4, group_size=32, sym=False),
    RTNConfig(bits=8, group_size=-1, sym=False),
    RTNConfig(bits=3, group_size=64, sym=True),
    GPTQConfig(bits=4, group_size=64),  # act-order with static groups: served as not act-ordered
    GPTQConfig(bits=4, group_size=-1, static_groups=False),  # dynamic act-order, per channel
    GPTQConfig(bits=8, group_size=128, act_order=False),
    AWQConfig(bits=4, group_size=64),
]


def test_the_registry_is_keyed_by_each_module_name():
    assert FORMATS == {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors}
    assert all(name == module.NAME for name, module in FORMATS.items())


def _stores(module, config) -> bool:
    try:
        module.check_supported(config)
    except ConfigError:
        return False
    return True


STORED = [(name, config) for name, module in FORMATS.items() for config in CONFIGS if _stores(module, config)]


@pytest.mark.parametrize("name,config", STORED, ids=[f"{name}-{i}" for i, (name, _) in enumerate(STORED)])
def test_read_config_gives_back_the_numbers_written(name, config):
    module = FORMATS[name]
    quant = json.loads(json.dumps(module.quantization_config(config)))  # as config.json holds it
    scheme = read_quantization_config(quant)
    assert scheme == module.read_config(quant)
    assert scheme.format is module and scheme.bits == config.bits and scheme.group_size == config.group_size
    if module is awq:  # symmetric weights are stored as zero points of 8 (awq module docstring)
        assert (scheme.sym, scheme.zero_point, scheme.desc_act) == (False, True, False)
        assert scheme.required == awq.SUFFIXES
        return
    assert scheme.sym == config.sym and scheme.zero_point == (not config.sym)
    dynamic = config.act_order and not config.static_groups
    assert scheme.desc_act == (dynamic if module is gptq else False)  # compressed-tensors writes actorder "weight"
    zero_points = () if module is gptq or config.sym else ("weight_zero_point",)
    assert scheme.required == module.SUFFIXES + zero_points


def test_awq_reads_autoawq_spellings():
    scheme = read_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
                                       "version": "GEMM"})
    assert (scheme.bits, scheme.group_size, scheme.zero_point) == (4, 128, True)


def _ct(**changes) -> dict:
    return {**compressed_tensors.quantization_config(RTNConfig(group_size=128)), **changes}


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "exl2"}, "quant_method 'exl2' is not supported; expected one of gptq, awq, compressed-tensors"),
    ({**gptq.quantization_config(RTNConfig(group_size=128)), "checkpoint_format": "gptq_v2"},
     "GPTQ checkpoint_format 'gptq_v2' is not supported; only v1 zeros (checkpoint_format 'gptq') are read"),
    ({**awq.quantization_config(RTNConfig(group_size=128)), "version": "gemv"},
     "AWQ version 'gemv' is not supported; only the GEMM layout is read"),
    (_ct(format="int-quantized"), "only single-scheme pack-quantized compressed-tensors checkpoints are read "
                                  "(format 'int-quantized', 1 config groups)"),
    (_ct(config_groups={}), "(format 'pack-quantized', 0 config groups)"),
])
def test_unsupported_variants_are_refused(quant, message):
    with pytest.raises(FormatError) as err:
        read_quantization_config(quant)
    assert message in str(err.value)


@pytest.mark.parametrize("config,expected", [
    (RTNConfig(bits=4, sym=True), "gptq"),
    (RTNConfig(bits=8, group_size=-1, sym=True), "gptq"),
    (RTNConfig(bits=4, group_size=64, sym=False), "awq"),
    (RTNConfig(bits=4, group_size=-1, sym=False), "compressed-tensors"),
    (RTNConfig(bits=8, sym=False), "compressed-tensors"),
    (RTNConfig(bits=5, sym=True), "compressed-tensors"),
])
def test_auto_chooses_the_widest_supported_layout(config, expected):
    assert choose_format(config) == expected
