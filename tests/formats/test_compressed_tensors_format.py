import itertools

import pytest
import torch

from toolkit.formats import compressed_tensors as ct
from toolkit.formats import gptq
from toolkit.quant.configs import ConfigError, GPTQConfig, RTNConfig
from toolkit.quant.primitives import quantize_rtn


def _weight(N, K, sym, seed=0):
    torch.manual_seed(seed)
    W = torch.randn(N, K) + (0 if sym else 0.5)
    if not sym:
        W[:, ::5] -= 3  # negative minima: zeros spread over the whole code range
    return W


# (20, 100): neither dim fills whole words at 4 bits, so both packed dims are padded like pack_to_int32 pads them
SHAPES = ((24, 96), (64, 256), (20, 100))
CASES = [(shape, bits, g, sym)
         for shape, bits, g, sym in itertools.product(SHAPES, (4, 8), (-1, 32, 64, 128), (True, False))
         if g == -1 or shape[1] % g == 0]


@pytest.mark.parametrize("shape,bits,group_size,sym", CASES)
def test_pack_unpack_is_exact(shape, bits, group_size, sym):
    N, K = shape
    qw = quantize_rtn(_weight(N, K, sym), bits, group_size, sym, bias=torch.randn(N))
    tensors = ct.pack(qw, torch.bfloat16)
    G = 1 if group_size == -1 else K // group_size
    assert tensors["weight_packed"].shape == (N, -(-K * bits // 32)) and tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_scale"].shape == (N, G) and tensors["weight_scale"].dtype == torch.bfloat16
    assert tensors["weight_shape"].tolist() == [N, K] and tensors["weight_shape"].dtype == torch.int64
    assert tensors["bias"].dtype == torch.bfloat16
    if sym:
        assert "weight_zero_point" not in tensors
    else:
        assert tensors["weight_zero_point"].shape == (-(-N * bits // 32), G)
        assert tensors["weight_zero_point"].dtype == torch.int32
    assert "weight_g_idx" not in tensors
    back = ct.unpack(tensors, bits, group_size, sym)
    assert torch.equal(back.codes, qw.codes)
    assert torch.equal(back.zero, qw.zero)
    assert torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.scale, qw.scale.bfloat16().float())
    assert torch.equal(ct.dequantize(tensors, bits), back.dequantize())


def test_golden_words_from_the_format_reference():
    # docs/formats.md §1.1: codes 1..8 in eight consecutive input columns → 0x87654321 (sequential, like GPTQ)
    qw = quantize_rtn(torch.randn(8, 32), 4, -1, True)
    qw.codes[0, :8] = torch.arange(1, 9, dtype=torch.uint8)
    assert ct.pack(qw)["weight_packed"][0, 0].item() == -2023406815


def test_symmetric_4bit_equals_gptq_transposed():
    # docs/formats.md §4: same grid, so one calibration run is written bit for bit in both layouts
    qw = quantize_rtn(_weight(64, 256, True), 4, 128, True)
    ours, theirs = ct.pack(qw, torch.float16), gptq.pack(qw)
    assert torch.equal(ours["weight_packed"], theirs["qweight"].t())
    assert torch.equal(ours["weight_scale"], theirs["scales"].t())


def test_act_order_static_groups_only():
    qc = ct.quantization_config(GPTQConfig(act_order=True, static_groups=True, group_size=64))
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    with pytest.raises(ConfigError, match="actorder: group"):
        ct.check_supported(GPTQConfig(act_order=True, static_groups=False, group_size=64))
    qw = quantize_rtn(torch.randn(16, 64), 4, 32, True)
    qw.g_idx = qw.g_idx.flip(0)
    with pytest.raises(ValueError, match="actorder 'group'"):
        ct.pack(qw)


def test_legacy_group_act_order_checkpoints_are_read():
    """Older llm-compressor wrote ``weight_g_idx`` with actorder group; dequantize and unpack follow it."""
    qw = quantize_rtn(torch.randn(16, 64), 4, 32, False)
    tensors = ct.pack(qw)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    g_idx = qw.g_idx[perm]  # columns in a new group order; codes stay where they are
    tensors["weight_g_idx"] = g_idx
    expected = qw.scale[:, g_idx.long()] * (qw.codes.float() - qw.zero[:, g_idx.long()].float())
    assert torch.allclose(ct.dequantize(tensors, 4), expected, rtol=1e-3)
    assert torch.equal(ct.unpack(tensors, 4, 32, False).g_idx, g_idx)


def test_refuses_other_widths():
    with pytest.raises(ConfigError, match="4 or 8-bit"):
        ct.check_supported(RTNConfig(bits=3))
    ct.check_supported(RTNConfig(bits=8, sym=False, group_size=-1))


def test_quantization_config_minimal_keys():
    qc = ct.quantization_config(RTNConfig(bits=4, group_size=128, sym=True))
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"] is None
    group = qc["config_groups"]["group_0"]
    assert set(group) == {"targets", "weights"} and group["targets"] == ["Linear"]
    assert group["weights"] == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                                "dynamic": False, "actorder": None, "observer": "minmax"}
    channel = ct.quantization_config(RTNConfig(bits=8, group_size=-1, sym=False))["config_groups"]["group_0"]["weights"]
    assert channel["strategy"] == "channel" and channel["group_size"] is None and channel["symmetric"] is False


@pytest.mark.parametrize("config", [RTNConfig(group_size=128), RTNConfig(bits=8, sym=False, group_size=-1),
                                    GPTQConfig(act_order=True, group_size=32, skip=("lm_head", "mlp.down_proj"))])
def test_strict_parser_accepts_the_config(config):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(ct.quantization_config(config))  # QuantizationArgs: extra="forbid"
    weights = parsed.config_groups["group_0"].weights
    assert (weights.num_bits, weights.symmetric) == (config.bits, config.sym)
    assert weights.strategy == ("channel" if config.group_size == -1 else "group")


def test_pack_matches_pack_to_int32_with_padding():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for bits in (4, 8):
        qw = quantize_rtn(_weight(20, 100, False), bits, -1, False)
        tensors = ct.pack(qw)
        offset = 1 << (bits - 1)
        signed_codes = (qw.codes.to(torch.int32) - offset).to(torch.int8)
        signed_zero = (qw.zero - offset).to(torch.int8)
        assert torch.equal(tensors["weight_packed"], pack_to_int32(signed_codes, bits))
        assert torch.equal(tensors["weight_zero_point"], pack_to_int32(signed_zero, bits, packed_dim=0))


@pytest.mark.parametrize("bits,group_size,sym,full_range", [(4, 32, True, False), (4, 64, False, False),
                                                           (8, -1, False, False), (4, 32, True, True)])
def test_compressed_tensors_decompressor_agrees_on_a_written_checkpoint(tmp_path, tiny_llama_dir, bits, group_size,
                                                                        sym, full_range):
    """compressed-tensors' own model-free dequantizer reads config.json and the safetensors file we wrote."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    from toolkit.quantize import QuantizeSettings, quantize

    config = RTNConfig(bits=bits, group_size=group_size, sym=sym, full_range=full_range)  # full range: scales < 0
    out = quantize(str(tiny_llama_dir), config, tmp_path / "q",
                   settings=QuantizeSettings(format="compressed-tensors", dtype="float16")).output
    tensors = load_file(out / "model.safetensors")
    theirs = CompressedTensorsDequantizer(out, dtype=torch.float16).validate(dict(tensors))
    modules = {k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
    assert len(modules) == 14
    for module in modules:
        ours = ct.dequantize({s: t for k, t in tensors.items() if (s := k.removeprefix(module + ".")) != k}, bits)
        assert torch.equal(theirs[f"{module}.weight"], ours.half())  # their fp16 (q − zp)·scale: one rounding
