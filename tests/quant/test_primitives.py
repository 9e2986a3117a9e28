import dataclasses
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
    with pytest.raises(ConfigError, match="--method must be one of rtn, gptq, awq, awq\\+gptq, signround, got 'hqq'"):
        make_config("hqq")
    with pytest.raises(ConfigError, match="takes no option"):
        make_config("rtn", damp=0.1)
    assert make_config("gptq", damp=None, group_size=64) == GPTQConfig(group_size=64)


def llama_cpp_q4_0(W):
    """A transcription of llama.cpp's ``quantize_row_q4_0_ref`` (ggml-quants.c) per block of 32: the first value of
    largest magnitude is ``max``, d = max / −8 (stored as fp16), codes MIN(15, (int8)(x·(1/d) + 8.5)), computed
    with the float32 d. Returns codes [N, K] and fp16 d [N, K/32] as float32."""
    N, K = W.shape
    blocks = W.float().reshape(N, K // 32, 32)
    first = blocks.abs().argmax(dim=-1, keepdim=True)  # the first maximal index, as llama.cpp's strict `<`
    d = blocks.gather(-1, first).squeeze(-1) / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = (blocks * inverse[..., None] + 8.5).trunc().clamp(max=15)
    return codes.reshape(N, K).to(torch.uint8), d.to(torch.float16).float()


def test_the_gguf_rule_is_llama_cpps_q4_0_on_fp16_weights():
    from toolkit.quant.primitives import GGUF_RULE

    torch.manual_seed(0)
    W = (torch.randn(64, 256) * torch.rand(64, 1) * 0.1).half().float()  # weights as a checkpoint stores them
    ours = quantize_rtn(W, 4, 32, True, rule=GGUF_RULE)
    codes, d = llama_cpp_q4_0(W)
    assert torch.equal(ours.scale, d) and torch.equal(ours.scale.half().float(), ours.scale)
    assert bool((ours.scale < 0).any()) and bool((ours.scale > 0).any())  # the sign follows the extreme
    assert ours.codes.max() <= 15 and torch.equal(ours.zero, torch.full_like(ours.zero, 8))
    # llama.cpp rounds x·(1/d) half up, compound x/d half to even: they may differ only on a tie
    ratio = (W / ours.scale.repeat_interleave(32, dim=1)).double()
    tie = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4
    differ = ours.codes != codes
    assert not bool((differ & ~tie).any()) and int(differ.sum()) <= 4
    # each block's largest-magnitude weight is reproduced exactly, on code 0 (q − 8 = −8)
    blocks = W.reshape(64, 8, 32)
    first = blocks.abs().argmax(dim=-1, keepdim=True)
    deq = ours.dequantize().reshape(64, 8, 32)
    assert torch.equal(deq.gather(-1, first), blocks.gather(-1, first))
    assert bool((ours.codes.reshape(64, 8, 32).gather(-1, first) == 0).all())


@pytest.mark.parametrize("sym", [True, False])
def test_the_gguf_rule_chooses_the_nearest_code_on_the_fp16_grid_it_stores(sym):
    from toolkit.quant.primitives import GGUF_RULE, dequantize

    torch.manual_seed(1)
    W = torch.randn(32, 512) * torch.rand(32, 1)  # float32 weights: their scales are not fp16 values
    qw = quantize_rtn(W, 4, 32, sym, rule=GGUF_RULE)
    assert torch.equal(qw.scale.half().float(), qw.scale)
    step = qw.scale.abs()[:, qw.g_idx.long()].double()
    error = (qw.dequantize().double() - W.double()).abs()
    inside = (qw.codes > 0) & (qw.codes < 15)  # not clamped: the nearest grid point is at most half a step away
    assert bool((error[inside] <= step[inside] / 2 * (1 + 1e-6)).all())
    # the negative control: codes chosen against the unrounded float32 scale, then stored with an fp16 scale,
    # miss the nearest point of the stored grid
    unrounded = quantize_rtn(W, 4, 32, sym, rule=dataclasses.replace(GGUF_RULE, dtype=None))
    stored = unrounded.scale.half().float()
    miss = (dequantize(unrounded.codes, stored, unrounded.zero.float(), unrounded.g_idx).double() - W.double()).abs()
    assert bool((miss[inside] > step[inside] / 2 * (1 + 1e-6)).any())


def test_the_gptq_rule_stays_the_default():
    torch.manual_seed(2)
    W = torch.randn(8, 64)
    qw = quantize_rtn(W, 4, 32, True)
    amax = W.reshape(8, 2, 32).abs().amax(-1)
    assert torch.allclose(qw.scale, 2 * amax / 15) and bool((qw.scale > 0).all())


@pytest.mark.parametrize("bits", [3, 4])
def test_the_full_range_rule_puts_each_groups_extreme_on_an_end_code_and_rounds_closer(bits):
    """AutoRound's and llama.cpp's symmetric grid, as a textbook loop: d = extreme / −2^(bits−1), codes
    clamp(round(w / d) + 2^(bits−1), 0, maxq). Every code is used and the error is below the GPTQ grid's."""
    from toolkit.quant.primitives import FULL_RANGE_RULE

    torch.manual_seed(3)
    W = torch.randn(16, 128)
    qw = quantize_rtn(W, bits, 32, True, rule=FULL_RANGE_RULE)
    half = 2 ** (bits - 1)
    expected = torch.empty_like(W)
    for n in range(16):
        for start in range(0, 128, 32):
            w = W[n, start:start + 32]
            extreme = w[w.abs().argmax()]
            d = extreme / -half
            expected[n, start:start + 32] = d * (torch.clamp(torch.round(w / d) + half, 0, 2 * half - 1) - half)
    torch.testing.assert_close(qw.dequantize(), expected, rtol=0, atol=1e-6)
    assert int(qw.codes.min()) == 0 and int(qw.codes.max()) == 2 * half - 1
    assert bool((qw.scale < 0).any()) and bool((qw.scale > 0).any())
    gptq = quantize_rtn(W, bits, 32, True)
    assert (qw.dequantize() - W).square().sum() < 0.95 * (gptq.dequantize() - W).square().sum()


def test_full_range_is_a_symmetric_option_that_gguf_implies():
    from toolkit.quant.primitives import FULL_RANGE_RULE, GGUF_RULE, GPTQ_RULE

    assert GPTQConfig(sym=True, full_range=True).scale_rule == FULL_RANGE_RULE and GPTQConfig().scale_rule == GPTQ_RULE
    assert GPTQConfig(sym=True, full_range=True, gguf=True).scale_rule == GGUF_RULE == GPTQConfig(gguf=True).scale_rule
    with pytest.raises(ConfigError, match="--full-range is a symmetric grid; method 'awq' is asymmetric here: pass "
                                          "--sym with it"):
        make_config("awq", full_range=True)
