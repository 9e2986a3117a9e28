import pytest
import torch
from typer.testing import CliRunner

from conftest import refused as conftest_refused
from toolkit.cli import app
from toolkit.decode.kv_cache import KVCache, dequantize_int8, quantize_int8


def test_int8_per_token_per_head_round_trip():
    x = torch.randn(1, 3, 20, 16, generator=torch.Generator().manual_seed(0))
    x[0, 1, 5] *= 50  # an outlier token spoils only its own scale
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (1, 3, 20, 1)
    error = dequantize_int8(q, scale, torch.float32) - x
    assert (error.abs() <= scale / 2 + 1e-7).all()
    sqnr = 10 * torch.log10(x.pow(2).sum() / error.pow(2).sum())
    assert sqnr > 35


def test_given_scale_is_used_and_clipped():
    q, scale = quantize_int8(torch.tensor([[0.5, -3.0, 100.0]]), 0.1)
    assert q.tolist() == [[5, -30, 127]] and scale.tolist() == [[pytest.approx(0.1)]]


def test_kv_scales_shape_and_dtype_are_checked():
    with pytest.raises(ValueError, match=r"\[layers, 2\] = \[2, 2\]"):
        KVCache(2, 1, 8, 4, torch.float32, torch.int8, kv_scales=torch.ones(2))
    with pytest.raises(ValueError, match="only apply to an INT8 cache"):
        KVCache(2, 1, 8, 4, torch.float32, None, kv_scales=torch.ones(2, 2))


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_keep_moves_the_accepted_slots_next_to_the_prefix(kv_dtype):
    cache = KVCache(1, 1, 10, 2, torch.float32, kv_dtype)
    values = torch.arange(1.0, 11.0)[None, None, :, None].expand(1, 1, 10, 2)  # slot i holds i + 1
    cache.write(0, 0, values, -values)
    cache.keep(3, [0, 2, 3, 6])
    k, v = cache.read(0, 7)
    assert k[0, 0, :, 0].tolist() == pytest.approx([1, 2, 3, 4, 6, 7, 10], rel=1e-2)
    assert v[0, 0, :, 0].tolist() == pytest.approx([-1, -2, -3, -4, -6, -7, -10], rel=1e-2)


WIDTH = 80


def run(*args, **env):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(WIDTH), **env})


def test_decode_runs_with_a_checkpoints_int8_scales(tmp_path, tiny_llama_dir):
    import torch

    from toolkit.quant.configs import RTNConfig
    from toolkit.quant.kv_cache import decode_scales, int8_decode_scales
    from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize
    from toolkit.runtime.load import load_quantized, read_manifest

    calibration = CalibrationSpec(samples=2, seq_len=32)
    scaled = quantize(str(tiny_llama_dir), RTNConfig(group_size=32), tmp_path / "int8", calibration,
                      QuantizeSettings(kv_cache="int8")).output
    plain = quantize(str(tiny_llama_dir), RTNConfig(group_size=32), tmp_path / "plain").output
    for checkpoint, cache, scaling in ((scaled, "int8-static", "calibrated scales"), (scaled, "int8", "per-token scales"),
                                       (plain, "int8", "per-token scales")):
        result = run("decode", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "2", "--kv-cache-dtype",
                     cache)
        assert result.exit_code == 0, result.output
        assert f"KV cache {cache}, {scaling}" in " ".join(result.output.split())
    conftest_refused(run("decode", "--model", plain, "--prompt", "Hi", "--kv-cache-dtype", "int8-static"),
                     "--kv-cache-dtype int8-static", "has none")
    model, _ = load_quantized(scaled)
    manifest = read_manifest(scaled)
    torch.testing.assert_close(int8_decode_scales(model, manifest), decode_scales(model))
    fp8 = {**manifest, "kv_cache": {**manifest["kv_cache"], "dtype": "fp8"}}
    assert int8_decode_scales(model, fp8) is None  # amax / 448 would saturate an INT8 cache
    help_text = " ".join(run("quantize", "--help", COLUMNS="200").output.split())
    assert "compound decode --kv-cache-dtype int8-static" in help_text
