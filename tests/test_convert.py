import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.convert import ConversionError, convert
from toolkit.formats import awq, compressed_tensors, gptq
from toolkit.quant.configs import ConfigError, RTNConfig
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize
from toolkit.runtime.load import load_quantized
from toolkit.runtime.quant_linear import QuantLinear


def _logits(directory):
    model, _ = load_quantized(directory)
    tokens = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits


def _codes(directory, layout, bits=4, group_size=32, sym=True):
    """Unsigned codes [N, K] of every quantized linear, unpacked from ``layout``'s tensors."""
    tensors = load_file(directory / "model.safetensors")
    marker = "." + layout.SUFFIXES[0]
    out = {}
    for name in (k.removesuffix(marker) for k in tensors if k.endswith(marker)):
        parts = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == name}
        out[name] = layout.unpack(parts, bits, group_size, sym).codes
    return out


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("convert")
    return quantize(str(tiny_llama_dir), RTNConfig(bits=4, group_size=32, sym=True), root / "gptq",
                    settings=QuantizeSettings(format="gptq")).output


def test_gptq_to_compressed_tensors_to_awq_to_gptq_is_bit_exact(tmp_path, gptq_dir):
    ct = convert(gptq_dir, "compressed-tensors", tmp_path / "ct")
    aw = convert(ct, "awq", tmp_path / "awq")
    back = convert(aw, "gptq", tmp_path / "gptq")

    codes = _codes(gptq_dir, gptq)
    assert len(codes) == 14
    for directory, layout in ((ct, compressed_tensors), (aw, awq), (back, gptq)):
        got = _codes(directory, layout)
        assert got.keys() == codes.keys() and all(torch.equal(got[k], codes[k]) for k in codes)
    original, final = load_file(gptq_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == final.keys()
    assert all(torch.equal(original[k], final[k]) for k in original)  # every tensor, bit for bit

    expected = _logits(gptq_dir)
    for directory, fmt in ((ct, "compressed-tensors"), (aw, "awq"), (back, "gptq")):
        model, _ = load_quantized(directory)
        assert {m.layout.NAME for m in model.modules() if isinstance(m, QuantLinear)} == {fmt}
        assert torch.allclose(_logits(directory), expected, rtol=0, atol=1e-5)

    manifest = json.loads((back / "compound.json").read_text())
    assert manifest["format"] == "gptq" and manifest["quantization"]["method"] == "rtn"
    assert [(c["from"], c["to"]) for c in manifest["conversions"]] == [
        ("gptq", "compressed-tensors"), ("compressed-tensors", "awq"), ("awq", "gptq")]
    assert manifest["conversions"][0]["source_files"] == json.loads((gptq_dir / "compound.json").read_text())["files"]
    assert (back / "tokenizer.json").is_file() and (back / "chat_template.jinja").is_file()
    assert json.loads((back / "config.json").read_text())["quantization_config"] == \
        json.loads((gptq_dir / "config.json").read_text())["quantization_config"]


def test_asymmetric_awq_converts_to_compressed_tensors_but_not_to_gptq(tmp_path, tiny_llama_dir):
    src = quantize(str(tiny_llama_dir), RTNConfig(bits=4, group_size=32, sym=False), tmp_path / "awq").output
    ct = convert(src, "compressed-tensors", tmp_path / "ct")
    assert "weight_zero_point" in "".join(load_file(ct / "model.safetensors"))
    assert torch.allclose(_logits(ct), _logits(src), rtol=0, atol=1e-5)
    for directory in (src, ct):
        with pytest.raises(ConversionError, match="asymmetric"):
            convert(directory, "gptq", tmp_path / "never")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("bits,src_fmt,fmt,reason", [
    (8, "compressed-tensors", "awq", "4-bit"),
    (3, "gptq", "compressed-tensors", "4 or 8"),
    (3, "gptq", "awq", "4-bit"),
])
def test_bit_widths_a_target_cannot_hold_are_refused(tmp_path, tiny_llama_dir, bits, src_fmt, fmt, reason):
    src = quantize(str(tiny_llama_dir), RTNConfig(bits=bits, group_size=32, sym=True), tmp_path / "src",
                   settings=QuantizeSettings(format=src_fmt)).output
    with pytest.raises(ConversionError, match=reason):
        convert(src, fmt, tmp_path / "out")


def test_act_order_groups_are_refused_by_awq(tmp_path, gptq_dir):
    import shutil

    src = tmp_path / "act-order"
    shutil.copytree(gptq_dir, src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name][torch.randperm(tensors[name].numel(), generator=torch.Generator().manual_seed(0))]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="act-order"):
        convert(src, "awq", tmp_path / "awq")


def test_nothing_to_convert_and_unknown_formats_are_refused(tmp_path, gptq_dir):
    with pytest.raises(ConfigError, match="already"):
        convert(gptq_dir, "gptq", tmp_path / "same")
    with pytest.raises(ConfigError, match="--format must be one of"):
        convert(gptq_dir, "exl2", tmp_path / "exl2")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(gptq_dir, "awq", gptq_dir)


def test_fp8_kv_scales_are_carried_and_declared(tmp_path, tiny_llama_dir):
    calibration = CalibrationSpec("sharegpt", samples=2, seq_len=32)
    src = quantize(str(tiny_llama_dir), RTNConfig(bits=4, group_size=32, sym=True), tmp_path / "gptq", calibration,
                   settings=QuantizeSettings(format="gptq", kv_cache="fp8")).output
    ct = convert(src, "compressed-tensors", tmp_path / "ct")
    scheme = json.loads((ct / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme["type"] == "float" and scheme["strategy"] == "tensor"
    before, after = load_file(src / "model.safetensors"), load_file(ct / "model.safetensors")
    assert torch.equal(before["model.layers.1.self_attn.v_scale"], after["model.layers.1.self_attn.v_scale"])


def test_cli_convert(tmp_path, gptq_dir):
    from typer.testing import CliRunner

    from toolkit.cli import app

    result = CliRunner().invoke(app, ["convert", "--model", str(gptq_dir), "--format", "awq", "--output",
                                      str(tmp_path / "awq")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    result = CliRunner().invoke(app, ["convert", "--model", str(tmp_path / "awq"), "--format", "awq", "--output",
                                      str(tmp_path / "again")])
    assert result.exit_code == 2 and "already" in result.output
