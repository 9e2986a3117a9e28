import pytest
import torch

from conftest import tiny_model
from toolkit.engine import ActivationError, quantize_layers
from toolkit.methods import driver_for
from toolkit.quant.configs import ConfigError, RTNConfig
from toolkit.quant.primitives import quantize_rtn


def test_rtn_quantizes_every_decoder_linear_in_place():
    model = tiny_model("qwen2", vocab=128)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    sunk = {}
    errors = quantize_layers(model, RTNConfig(group_size=32), driver_for("rtn"), None, sunk.__setitem__)
    assert sorted(sunk) == sorted(n for n in originals if n != "lm_head") == sorted(errors)
    for name, qweight in sunk.items():
        expected = quantize_rtn(originals[name], 4, 32, True).dequantize()
        assert torch.equal(model.get_submodule(name).weight, expected)
        assert torch.equal(qweight.dequantize(), expected)
    assert torch.equal(model.lm_head.weight, originals["lm_head"])


def test_skip_by_suffix():
    model = tiny_model("llama", vocab=128)
    sunk = {}
    config = RTNConfig(group_size=32, skip=("lm_head", "mlp.down_proj"))
    quantize_layers(model, config, driver_for("rtn"), None, sunk.__setitem__)
    assert not any(n.endswith("down_proj") for n in sunk) and len(sunk) == 12


def test_group_size_not_dividing_width_is_refused_before_work():
    model = tiny_model("llama", hidden=96, vocab=128)
    with pytest.raises(ConfigError, match="does not divide the input width of model.layers.0.self_attn.q_proj"):
        quantize_layers(model, RTNConfig(group_size=64), driver_for("rtn"), None, lambda *a: pytest.fail("ran"))


def test_nan_activations_are_named():
    model = tiny_model("llama", vocab=128)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
    tokens = torch.full((2, 8), 5)

    class CalibratedRTN(RTNConfig):
        needs_activations = True

    with pytest.raises(ActivationError, match="NaN or infinite activations after the embeddings"):
        quantize_layers(model, CalibratedRTN(group_size=32), lambda session: {}, tokens, lambda *a: None)
