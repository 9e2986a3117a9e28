import itertools

import pytest
import torch

from toolkit.formats import awq
from toolkit.quant.configs import AWQConfig, ConfigError, GPTQConfig, RTNConfig
from toolkit.quant.primitives import QuantizedWeight, quantize_rtn


def _weight(N, K, sym, seed=0):
    torch.manual_seed(seed)
    W = torch.randn(N, K) + (0 if sym else 0.5)
    if not sym:
        W[:, ::5] -= 3  # negative minima: zeros spread over 0..15
    return W


CASES = [(shape, g, sym) for shape, g, sym in itertools.product(((24, 96), (64, 256)), (-1, 32, 64, 128), (True, False))
         if g == -1 or shape[1] % g == 0]


@pytest.mark.parametrize("shape,group_size,sym", CASES)
def test_pack_unpack_is_exact(shape, group_size, sym):
    N, K = shape
    qw = quantize_rtn(_weight(N, K, sym), 4, group_size, sym, bias=torch.randn(N))
    tensors = awq.pack(qw)
    G = 1 if group_size == -1 else K // group_size
    assert tensors["qweight"].shape == (K, N // 8) and tensors["qweight"].dtype == torch.int32
    assert tensors["qzeros"].shape == (G, N // 8) and tensors["qzeros"].dtype == torch.int32
    assert tensors["scales"].shape == (G, N) and tensors["scales"].dtype == torch.float16
    assert tensors["bias"].dtype == torch.float16 and set(tensors) == {"qweight", "qzeros", "scales", "bias"}
    back = awq.unpack(tensors, 4, group_size, sym)
    assert torch.equal(back.codes, qw.codes)
    assert torch.equal(back.zero, qw.zero)
    assert torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.scale, qw.scale.half().float())
    assert torch.equal(awq.dequantize(tensors, 4), back.dequantize())


def test_golden_words_from_the_format_reference():
    # docs/formats.md §1.1: codes 1..8 in eight consecutive output columns → nibbles 1 3 5 7 2 4 6 8 → 0x86427531
    codes = torch.arange(1, 9, dtype=torch.uint8).view(8, 1)  # (N=8, K=1)
    zero = torch.arange(1, 9, dtype=torch.int32).view(8, 1)
    qw = QuantizedWeight(codes, torch.ones(8, 1), zero, torch.zeros(1, dtype=torch.int32), 4, -1, False)
    tensors = awq.pack(qw)
    assert tensors["qweight"].item() == -2042464975  # 0x86427531 as int32
    assert tensors["qzeros"].item() == -2042464975  # zeros use the same interleave, stored as is


def test_symmetric_zero_is_stored_as_eight():
    qw = quantize_rtn(torch.randn(8, 64), 4, 64, True)
    assert awq.pack(qw)["qzeros"].item() == -2004318072  # 0x88888888: zero 8 stored as is, unlike GPTQ v1's 7


def test_pack_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.pack(quantize_rtn(torch.randn(12, 64), 4, 32, False))
    with pytest.raises(ValueError, match="4-bit"):
        awq.pack(quantize_rtn(torch.randn(16, 64), 8, 32, False))
    qw = quantize_rtn(torch.randn(16, 64), 4, 32, False)
    qw.g_idx = qw.g_idx.flip(0)  # act-order groups
    with pytest.raises(ValueError, match="g_idx"):
        awq.pack(qw)


def test_refuses_what_loaders_refuse():
    with pytest.raises(ConfigError, match="4-bit weights only"):
        awq.check_supported(AWQConfig(bits=8))
    with pytest.raises(ConfigError, match="positive group size"):
        awq.check_supported(AWQConfig(group_size=-1))
    with pytest.raises(ConfigError, match="dynamic groups"):
        awq.check_supported(GPTQConfig(act_order=True, static_groups=False, group_size=64))
    awq.check_supported(GPTQConfig(act_order=True, static_groups=True, group_size=64))
    awq.check_supported(RTNConfig(sym=True))  # symmetric is representable: zeros of 8


@pytest.mark.parametrize("sym", [True, False])
def test_quantization_config_is_autoawq_shaped(sym):
    qc = awq.quantization_config(AWQConfig(group_size=64, sym=sym))
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": None, "lm_head": False}
    qc = awq.quantization_config(AWQConfig(skip=("lm_head", "mlp.down_proj")))
    assert qc["modules_to_not_convert"] == ["mlp.down_proj"]


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_awq_converter_reads_our_tensors(sym):
    """An independent reader: compressed-tensors' AutoAWQ → pack-quantized converter, then its decompressor."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    qw = quantize_rtn(_weight(24, 96, sym), 4, 32, sym)
    tensors = {f"layer.{k}": v for k, v in awq.pack(qw).items()}
    converter = AutoAWQConverter.from_autoawq_config(awq.quantization_config(AWQConfig(group_size=32, sym=sym)))
    converted = converter.process(dict(tensors))
    scheme = next(iter(converter.update_config(None).config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    theirs = compressor.decompress({k.removeprefix("layer."): v for k, v in converted.items()}, scheme)["weight"]
    ours = awq.dequantize(awq.pack(qw), 4)
    assert theirs.dtype == torch.float16  # computed in the scales' dtype: one rounding of an exact product
    assert torch.equal(theirs.float(), ours.half().float())
