"""An unset group size becomes the largest standard size dividing every quantized width, with the reason; a given
one is checked against every width."""

import pytest

from toolkit.quant.configs import ConfigError, GPTQConfig, RTNConfig

SMOLLM2 = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.mlp.down_proj": 1536}


@pytest.mark.parametrize("widths,expected", [
    ({"a": 4096, "b": 14336}, 128),
    (SMOLLM2, 64),
    ({"a": 96, "b": 64}, 32),
])
def test_unset_becomes_the_largest_standard_size_dividing_every_width(widths, expected):
    config, why = GPTQConfig().fitted(widths)
    assert config.group_size == expected and all(k % expected == 0 for k in widths.values())
    assert config.damp == GPTQConfig().damp and config.act_order  # only the group size changes
    assert why.startswith("auto: the largest of 128, 64, 32 dividing every input width")


def test_the_reason_names_a_width_the_next_size_up_does_not_divide():
    _, why = RTNConfig().fitted(SMOLLM2)
    assert why.endswith("; 128 does not divide 576 (model.layers.0.self_attn.q_proj)")
    _, why = RTNConfig().fitted({"a": 128, "b": 96})
    assert why.endswith("; 64 does not divide 96 (b)")
    assert RTNConfig().fitted({"a": 256})[1] == "auto: the largest of 128, 64, 32 dividing every input width"


def test_no_standard_size_fits_names_the_widths_and_per_channel():
    with pytest.raises(ConfigError, match=r"no group size of 128, 64, 32 divides .* \(48, 64\); pass --group-size -1"):
        RTNConfig().fitted({"a": 64, "b": 48})


def test_a_given_size_is_checked_not_changed():
    config = RTNConfig(group_size=32)
    assert config.fitted(SMOLLM2) == (config, None)
    with pytest.raises(ConfigError, match=r"group_size 128 does not divide the input width of .*q_proj \(576 % 128"):
        RTNConfig(group_size=128).fitted(SMOLLM2)
    assert RTNConfig(group_size=-1).fitted({"a": 50}) == (RTNConfig(group_size=-1), None)


def test_gguf_fits_its_block_size_and_its_grid():
    from toolkit.quant.primitives import GGUF_RULE, GPTQ_RULE

    config, why = RTNConfig(gguf=True).fitted(SMOLLM2)
    assert config.group_size == 32 and why == "auto: GGUF blocks hold 32 weights (--gguf)"
    assert config.scale_rule == GGUF_RULE and RTNConfig().scale_rule == GPTQ_RULE
    with pytest.raises(ConfigError, match="group_size 32 does not divide the input width of a"):
        RTNConfig(gguf=True).fitted({"a": 48})
