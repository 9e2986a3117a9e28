import json

import pytest
import torch
from safetensors.torch import load_file

from toolkit.quant import kv_cache as kv
from toolkit.quant.configs import ConfigError, RTNConfig
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize

CALIBRATION = CalibrationSpec("sharegpt", samples=4, seq_len=48)


def test_scale_is_absmax_over_the_8_bit_maximum():
    x = torch.zeros(2, 3, 5, 4)  # (B, n_kv, T, head_dim)
    x[1, 0, 2, 3], x[0, 1, 4, 0] = -7.0, 3.5
    assert kv.absmax(x).item() == 7.0
    assert kv.absmax(x, per_head=True).tolist() == [7.0, 3.5, 0.0]
    assert kv.scale_from_absmax(torch.tensor(448.0), "fp8").item() == 1.0
    assert kv.scale_from_absmax(torch.tensor(254.0), "int8").item() == 2.0
    assert kv.scale_from_absmax(kv.absmax(x, per_head=True), "fp8").tolist() == [7 / 448, 3.5 / 448, 1.0]


def test_observer_keeps_the_running_max_and_passes_the_tensors_through():
    observer = kv.KVAbsMax(per_head=True)
    k1, v1 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    k2, v2 = 10 * torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4) / 10
    assert observer.update(k1, v1, 0) == (k1, v1)
    observer.update(k2, v2, 0, kwargs={})
    torch.testing.assert_close(observer.k_amax, torch.maximum(kv.absmax(k1, True), kv.absmax(k2, True)))
    torch.testing.assert_close(observer.v_amax, torch.maximum(kv.absmax(v1, True), kv.absmax(v2, True)))


def _hand_computed_kv_absmax(tokenizer, config):
    """Per layer (amax K after RoPE, amax V), recomputed by hand from k_proj / v_proj and the model's RoPE on the
    quantized model's hidden states (the in-memory RTN result the quantize verb produces)."""
    from conftest import tiny_model
    from toolkit.calibration import calibration_batch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from toolkit.engine.loop import quantize_layers
    from toolkit.methods import driver_for

    model = tiny_model("llama")
    quantize_layers(model, config, driver_for(config), None, lambda *a: None)
    tokens = calibration_batch(tokenizer, CALIBRATION.dataset, CALIBRATION.samples, CALIBRATION.seq_len, config.seed)
    B, T = tokens.shape
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states  # input of layer i = hidden[i]
        positions = torch.arange(T).expand(B, T)
        out = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden[i])
            k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)  # (B, n_kv, T, hd)
            v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
            cos, sin = model.model.rotary_emb(x, positions)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            out.append((k, v))
    return out


def test_fp8_scales_are_the_absmax_of_post_rope_keys_and_values(tmp_path, tiny_llama_dir, smol_tokenizer):
    from toolkit.runtime.load import load_quantized

    config = RTNConfig(bits=4, group_size=32, sym=True)
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q", CALIBRATION,
                   settings=QuantizeSettings(format="gptq", dtype="float32", kv_cache="fp8")).output
    tensors = load_file(out / "model.safetensors")
    expected = _hand_computed_kv_absmax(smol_tokenizer, config)
    for i, (k, v) in enumerate(expected):
        k_scale, v_scale = (tensors[f"model.layers.{i}.self_attn.{s}_scale"] for s in "kv")
        assert k_scale.shape == v_scale.shape == (1,) and k_scale.dtype == torch.float32
        torch.testing.assert_close(k_scale * 448, k.abs().amax().reshape(1), rtol=1e-5, atol=0)
        torch.testing.assert_close(v_scale * 448, v.abs().amax().reshape(1), rtol=1e-5, atol=0)
    manifest = json.loads((out / "compound.json").read_text())
    assert manifest["kv_cache"] == {"dtype": "fp8", "strategy": "tensor", "scale": "amax / 448"}
    assert manifest["calibration"]["samples"] == CALIBRATION.samples  # RTN alone needs no calibration; KV scales do
    assert "kv_cache_scheme" not in json.loads((out / "config.json").read_text())["quantization_config"]

    model, _ = load_quantized(out)  # the loader keeps them as buffers of self_attn
    torch.testing.assert_close(model.model.layers[1].self_attn.k_scale, tensors["model.layers.1.self_attn.k_scale"])
    assert kv.decode_scales(model).shape == (2, 2)


def test_per_head_scales_in_compressed_tensors_declare_the_kv_cache_scheme(tmp_path, tiny_llama_dir, smol_tokenizer):
    from toolkit.runtime.load import load_quantized

    config = RTNConfig(bits=4, group_size=32, sym=False)
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q", CALIBRATION,
                   settings=QuantizeSettings(format="compressed-tensors", dtype="float16", kv_cache="fp8",
                                             kv_cache_strategy="attn_head")).output
    tensors = load_file(out / "model.safetensors")
    expected = _hand_computed_kv_absmax(smol_tokenizer, config)
    for i, (k, v) in enumerate(expected):
        k_scale, v_scale = (tensors[f"model.layers.{i}.self_attn.{s}_scale"] for s in "kv")
        assert k_scale.shape == v_scale.shape == (2, 1, 1) and k_scale.dtype == torch.float16  # n_kv = 2
        per_head = lambda x: x.transpose(0, 1).reshape(2, -1).abs().amax(1).reshape(2, 1, 1)  # noqa: E731
        torch.testing.assert_close(k_scale.float(), (per_head(k) / 448).half().float(), rtol=2e-3, atol=0)
        torch.testing.assert_close(v_scale.float(), (per_head(v) / 448).half().float(), rtol=2e-3, atol=0)
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert scheme == {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    try:
        from compressed_tensors.quantization import QuantizationArgs
    except ImportError:
        pass
    else:
        QuantizationArgs(**scheme)  # the strict (extra="forbid") parser accepts it
    model, _ = load_quantized(out)
    assert model.model.layers[0].self_attn.v_scale.shape == (2, 1, 1)


def test_int8_scales_feed_the_decode_loop(tmp_path, tiny_llama_dir):
    from toolkit.decode.kv_cache import KVCache
    from toolkit.runtime.load import load_quantized

    out = quantize(str(tiny_llama_dir), RTNConfig(bits=4, group_size=32), tmp_path / "q", CALIBRATION,
                   settings=QuantizeSettings(format="awq", kv_cache="int8")).output
    tensors = load_file(out / "model.safetensors")
    model, _ = load_quantized(out)
    scales = kv.decode_scales(model)  # (layers, 2) = (k_scale, v_scale)
    assert scales[1, 1] == tensors["model.layers.1.self_attn.v_scale"].float().item()
    assert json.loads((out / "compound.json").read_text())["kv_cache"]["scale"] == "amax / 127"
    KVCache(layers=2, kv_heads=2, max_len=8, head_dim=16, dtype=torch.float32, kv_dtype=torch.int8, kv_scales=scales)


def test_kv_cache_settings_are_refused_before_any_work(tmp_path):
    config = RTNConfig()
    with pytest.raises(ConfigError, match="--kv-cache fp8"):
        quantize("no-such-model", config, tmp_path / "q",
                 settings=QuantizeSettings(format="compressed-tensors", kv_cache="int8"))
    with pytest.raises(ConfigError, match="must be one of"):
        quantize("no-such-model", config, tmp_path / "q", settings=QuantizeSettings(kv_cache="fp16"))
    with pytest.raises(ConfigError, match="strategy"):
        quantize("no-such-model", config, tmp_path / "q",
                 settings=QuantizeSettings(kv_cache="fp8", kv_cache_strategy="head"))


def test_cli_passes_the_kv_cache_options(tmp_path, tiny_llama_dir):
    from typer.testing import CliRunner

    from toolkit.cli import app

    args = ["quantize", "--model", str(tiny_llama_dir), "--output", str(tmp_path / "q"), "--group-size", "32"]
    result = CliRunner().invoke(app, [*args, "--format", "compressed-tensors", "--kv-cache", "int8"])
    assert result.exit_code == 2 and "--kv-cache fp8" in result.output
    result = CliRunner().invoke(app, [*args, "--kv-cache", "fp8", "--kv-cache-strategy", "attn_head",
                                      "--samples", "2", "--seq-len", "32"])
    assert result.exit_code == 0, result.output
    assert load_file(tmp_path / "q" / "model.safetensors")["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
