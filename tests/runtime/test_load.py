import pytest
import torch
from conftest import tiny_model

from toolkit.quant.configs import RTNConfig
from toolkit.quantize import QuantizeSettings, quantize
from toolkit.runtime.load import CheckpointError, load_quantized
from toolkit.runtime.quant_linear import QuantLinear


@pytest.mark.parametrize("bits,group_size,full_range", [(4, 32, False), (8, 64, False), (2, -1, False), (3, 32, False),
                                                       (3, 32, True)])
def test_checkpoint_round_trip_gives_the_fake_quantized_model(tmp_path, tiny_llama_dir, bits, group_size, full_range):
    config = RTNConfig(bits=bits, group_size=group_size, sym=True, full_range=full_range)  # the GPTQ layout
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q", settings=QuantizeSettings(dtype="float32")).output
    loaded, tokenizer = load_quantized(out, backend="reference")  # exact fp32 decode; other backends: test_quant_linear
    linears = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 14
    # the same model quantized in memory (weights replaced by their dequantized values) is the reference
    from toolkit.engine.loop import quantize_layers
    from toolkit.methods import driver_for

    reference = tiny_model("llama")
    quantize_layers(reference, config, driver_for(config), None, lambda *a: None)
    tokens = torch.randint(0, 49152, (2, 16))
    with torch.no_grad():
        expected, got = reference(tokens).logits, loaded(tokens).logits
    assert (expected - got).abs().max() < 1e-3 * expected.abs().max()
    assert tokenizer.chat_template is not None


def test_float_directory_is_not_a_quantized_checkpoint(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_quantized(tiny_llama_dir)


@pytest.fixture(scope="module")
def symmetric_checkpoints(tmp_path_factory, tiny_llama_dir):
    """The same RTN W4 g32 symmetric weights written as GPTQ, AWQ and compressed-tensors (fp16 scales in all three)."""
    root = tmp_path_factory.mktemp("sym-checkpoints")
    config = RTNConfig(bits=4, group_size=32, sym=True)
    return {fmt: quantize(str(tiny_llama_dir), config, root / fmt,
                          settings=QuantizeSettings(format=fmt, dtype="float16")).output
            for fmt in ("gptq", "awq", "compressed-tensors")}


def _logits(model, seed=0):
    tokens = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens).logits


def test_every_format_loads_to_the_same_logits_as_gptq(symmetric_checkpoints):
    from safetensors.torch import load_file

    expected = _logits(load_quantized(symmetric_checkpoints["gptq"])[0])
    for fmt in ("awq", "compressed-tensors"):
        directory = symmetric_checkpoints[fmt]
        model, _ = load_quantized(directory)
        linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        assert len(linears) == 14 and {m.layout.NAME for m in linears.values()} == {fmt}
        on_disk = set(load_file(directory / "model.safetensors"))
        for name, linear in linears.items():  # buffers carry the on-disk names: the state dict loaded without renaming
            assert {f"{name}.{s}" for s in linear.suffixes} <= on_disk
        assert torch.allclose(_logits(model), expected, rtol=0, atol=1e-5)


def test_asymmetric_awq_and_compressed_tensors_agree(tmp_path, tiny_llama_dir):
    config = RTNConfig(bits=4, group_size=64, sym=False)
    awq_dir = quantize(str(tiny_llama_dir), config, tmp_path / "awq", settings=QuantizeSettings(format="awq")).output
    ct_dir = quantize(str(tiny_llama_dir), config, tmp_path / "ct",
                      settings=QuantizeSettings(format="compressed-tensors")).output
    got_awq, got_ct = _logits(load_quantized(awq_dir)[0]), _logits(load_quantized(ct_dir)[0])
    assert torch.allclose(got_awq, got_ct, rtol=0, atol=1e-5)


def test_compressed_tensors_w8_channel_bf16_scales(tmp_path, tiny_llama_dir):
    from toolkit.engine.loop import quantize_layers
    from toolkit.methods import driver_for

    config = RTNConfig(bits=8, group_size=-1, sym=False)
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q",
                   settings=QuantizeSettings(format="compressed-tensors", dtype="bfloat16")).output
    loaded, _ = load_quantized(out)
    linear = loaded.get_submodule("model.layers.0.mlp.down_proj")
    assert linear.weight_scale.dtype == torch.bfloat16 and linear.weight_zero_point.dtype == torch.int32
    reference = tiny_model("llama")
    quantize_layers(reference, config, driver_for(config), None, lambda *a: None)
    expected, got = _logits(reference), _logits(loaded)
    assert (expected - got).abs().max() < 2e-2 * expected.abs().max()  # bf16 scales and fp16→bf16 float tensors


@pytest.mark.parametrize("edit,match", [({"checkpoint_format": "gptq_v2"}, "checkpoint_format"),
                                        ({"quant_method": "exl2"}, "not supported")])
def test_refuses_configs_whose_tensors_would_decode_wrong(tmp_path, symmetric_checkpoints, edit, match):
    import json
    import shutil

    directory = shutil.copytree(symmetric_checkpoints["gptq"], tmp_path / "c")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(edit)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_quantized(directory)
