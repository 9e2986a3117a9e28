import itertools

import pytest
import torch

from toolkit.formats import gptq
from toolkit.quant.configs import ConfigError, GPTQConfig, RTNConfig
from toolkit.quant.primitives import quantize_rtn


@pytest.mark.parametrize("bits,group_size,sym", list(itertools.product((2, 3, 4, 8), (-1, 32, 64, 128), (True, False))))
def test_pack_unpack_is_exact(bits, group_size, sym):
    torch.manual_seed(bits + group_size)
    W = torch.randn(64, 256) + (0 if sym else 0.5)
    if not sym:
        W[:, ::7] -= 3  # a negative minimum in every group: true zeros ≥ 1, which v1 zeros can store
    qw = quantize_rtn(W, bits, group_size, sym, bias=torch.randn(64))
    tensors = gptq.pack(qw)
    G = 1 if group_size == -1 else 256 // group_size
    assert tensors["qweight"].shape == (256 * bits // 32, 64) and tensors["qweight"].dtype == torch.int32
    assert tensors["qzeros"].shape == (G, 64 * bits // 32) and tensors["qzeros"].dtype == torch.int32
    assert tensors["scales"].shape == (G, 64) and tensors["scales"].dtype == torch.float16
    assert tensors["g_idx"].dtype == torch.int32 and tensors["bias"].dtype == torch.float16
    back = gptq.unpack(tensors, bits, group_size, sym)
    assert torch.equal(back.codes, qw.codes)
    assert torch.equal(back.zero, qw.zero)
    assert torch.equal(back.g_idx, qw.g_idx)
    assert torch.equal(back.scale, qw.scale.half().float())
    assert torch.allclose(gptq.dequantize(tensors, bits), back.dequantize())


def test_symmetric_zero_is_stored_minus_one():
    qw = quantize_rtn(torch.randn(8, 64), 4, 64, True)
    assert gptq.pack(qw)["qzeros"].item() == 0x77777777  # zero 8 stored as 7 (checkpoint_format "gptq", v1)


def test_refuses_what_vllm_refuses():
    with pytest.raises(ConfigError, match="asymmetric GPTQ"):
        gptq.check_supported(RTNConfig(sym=False))
    with pytest.raises(ConfigError, match="stores 2, 3, 4, 8 bits"):
        gptq.check_supported(RTNConfig(bits=5, sym=True))
    with pytest.raises(ConfigError, match="desc_act"):
        gptq.check_supported(GPTQConfig(sym=True, act_order=True, static_groups=False, group_size=64))
    gptq.check_supported(GPTQConfig(sym=True, act_order=True, static_groups=True, group_size=64))


def test_quantization_config_has_every_key_vllm_reads():
    qc = gptq.quantization_config(GPTQConfig(sym=True, group_size=64, act_order=True))
    for key in ("quant_method", "bits", "group_size", "desc_act", "sym", "lm_head", "checkpoint_format"):
        assert key in qc
    assert qc["desc_act"] is False and qc["static_groups"] is True and qc["checkpoint_format"] == "gptq"
