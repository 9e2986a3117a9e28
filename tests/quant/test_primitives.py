import itertools

import pytest
import torch

from toolkit.quant.configs import ConfigError, GPTQConfig, RTNConfig, make_config
from toolkit.quant.primitives import default_g_idx, group_qparams, max_code, quantize_rtn


def reference_rtn(W, bits, group_size, sym):
    """Straightforward per-group loop: the textbook min/max quantizer (range widened to include 0)."""
    N, K = W.shape
    size = K if group_size == -1 else group_size
    out = torch.empty_like(W)
    maxq = 2**bits - 1
    for n in range(N):
        for start in range(0, K, size):
            w = W[n, start : start + size]
            lo, hi = min(float(w.min()), 0.0), max(float(w.max()), 0.0)
            if sym:
                amax = max(abs(lo), hi)
                scale = 2 * amax / maxq or 1.0
                zero = 2 ** (bits - 1)
            else:
                scale = (hi - lo) / maxq or 1.0
                zero = round(-lo / scale)
            q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            out[n, start : start + size] = scale * (q - zero)
    return out


@pytest.mark.parametrize("bits,group_size,sym", list(itertools.product(range(2, 9), (-1, 32, 64, 128), (True, False))))
def test_rtn_matches_reference_and_error_bound(bits, group_size, sym):
    torch.manual_seed(bits * 1000 + group_size)
    W = torch.randn(12, 256) * torch.rand(12, 1) * 3
    qw = quantize_rtn(W, bits, group_size, sym)
    deq = qw.dequantize()
    assert torch.allclose(deq, reference_rtn(W, bits, group_size, sym), atol=1e-5)
    assert qw.codes.max() <= max_code(bits) and qw.codes.dtype == torch.uint8
    # every weight lies within half a step of its grid point (the range always covers the group)
    step = qw.scale[:, qw.g_idx.long()]
    assert ((deq - W).abs() <= step / 2 + 1e-5).all()


def test_more_bits_less_error():
    torch.manual_seed(0)
    W = torch.randn(64, 256)
    errors = [float((quantize_rtn(W, b, 64, True).dequantize() - W).norm()) for b in range(2, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] / float(W.norm()) < 0.01


def test_zero_group_is_exact_and_finite():
    W = torch.zeros(4, 64)
    W[0, :32] = torch.linspace(-1, 1, 32)
    for sym in (True, False):
        qw = quantize_rtn(W, 4, 32, sym)
        assert torch.isfinite(qw.scale).all()
        assert torch.equal(qw.dequantize()[1:], W[1:])


def test_group_qparams_shapes_and_g_idx():
    W = torch.randn(8, 128)
    scale, zero = group_qparams(W, 4, 32, False)
    assert scale.shape == zero.shape == (8, 4)
    assert default_g_idx(128, 32).tolist() == [k // 32 for k in range(128)]
    assert default_g_idx(128, -1).tolist() == [0] * 128


def test_config_validation_names_the_fix():
    with pytest.raises(ConfigError, match="bits must be between 2 and 8"):
        RTNConfig(bits=9)
    with pytest.raises(ConfigError, match="group_size must be one of"):
        RTNConfig(group_size=96)
    with pytest.raises(ConfigError, match=r"576 % 128 = 64\); try --group-size -1 or 32 or 64"):
        RTNConfig(group_size=128).check_width("model.layers.0.self_attn.q_proj", 576)
    with pytest.raises(ConfigError, match="unknown method"):
        make_config("hqq")
    with pytest.raises(ConfigError, match="takes no option"):
        make_config("rtn", damp=0.1)
    assert make_config("gptq", damp=None, group_size=64) == GPTQConfig(group_size=64)
