import pytest
import torch

from conftest import tiny_model
from toolkit.quant.configs import RTNConfig
from toolkit.quantize import quantize
from toolkit.runtime.load import CheckpointError, load_quantized
from toolkit.runtime.quant_linear import QuantLinear


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (2, -1), (3, 32)])
def test_checkpoint_round_trip_gives_the_fake_quantized_model(tmp_path, tiny_llama_dir, bits, group_size):
    config = RTNConfig(bits=bits, group_size=group_size)
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q", dtype=torch.float32).output
    loaded, tokenizer = load_quantized(out)
    linears = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 14
    # the same model quantized in memory (weights replaced by their dequantized values) is the reference
    from toolkit.engine import quantize_layers
    from toolkit.methods import driver_for

    reference = tiny_model("llama")
    quantize_layers(reference, config, driver_for("rtn"), None, lambda *a: None)
    tokens = torch.randint(0, 49152, (2, 16))
    with torch.no_grad():
        expected, got = reference(tokens).logits, loaded(tokens).logits
    assert (expected - got).abs().max() < 1e-3 * expected.abs().max()
    assert tokenizer.chat_template is not None


def test_float_directory_is_not_a_quantized_checkpoint(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_quantized(tiny_llama_dir)
