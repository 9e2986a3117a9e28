"""AWQ math (toolkit/quant/awq.py) on small random matrices: scale search, clip search, Gram factor, folding."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from toolkit.quant import awq
from toolkit.quant.primitives import quantize_rtn

BITS, GROUP = 4, 32


def _salient_inputs(tokens=1024, K=128, channels=4, factor=30.0, seed=0):
    """Gaussian activations [tokens, K] whose first ``channels`` channels are ``factor`` times larger."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(tokens, K, generator=g)
    X[:, :channels] *= factor
    return X


def _mse(X, W, W_hat):
    return float((X @ W_hat.T - X @ W.T).pow(2).mean())


def test_activation_scale_streams_over_chunks():
    X = torch.randn(3, 50, 16)
    expected = X.reshape(-1, 16).abs().mean(0)
    torch.testing.assert_close(awq.activation_scale(X), expected)
    torch.testing.assert_close(awq.activation_scale(iter([X[0], X[1:]])), expected)


@pytest.mark.parametrize("group_size,sym", [(32, False), (32, True), (-1, False)])
def test_fake_quantize_is_the_primitives_grid(group_size, sym):
    W = torch.randn(3, 16, 64)
    expected = torch.stack([quantize_rtn(w, BITS, group_size, sym).dequantize() for w in W])
    torch.testing.assert_close(awq.fake_quantize(W, BITS, group_size, sym), expected, rtol=0, atol=0)


def test_candidate_scales_start_at_plain_rounding_and_are_centred():
    alphas, s = awq.candidate_scales(torch.rand(64) * 10, grid=20)
    assert alphas[0] == 0 and alphas[-1] == pytest.approx(0.95)
    torch.testing.assert_close(s[0], torch.ones(64))
    torch.testing.assert_close(s.amax(1) * s.amin(1), torch.ones(20))


def test_search_scale_beats_plain_rounding_on_salient_channels():
    X = _salient_inputs()
    W = torch.randn(64, 128)
    found = awq.search_scale([W], awq.activation_scale(X), lambda ws: X @ ws[0].T, BITS, GROUP, sym=False)
    plain = _mse(X, W, awq.fake_quantize(W, BITS, GROUP, False))
    # The reported loss is the folded model's: Q(W·s) applied to X·s⁻¹.
    folded = awq.fake_quantize(awq.scale_input_columns(W, found.scales), BITS, GROUP, False)
    assert _mse(X / found.scales, W * found.scales, folded) == pytest.approx(found.loss, rel=1e-3)
    assert found.losses[0] == pytest.approx(plain, rel=1e-4)
    assert found.alpha > 0
    assert found.loss < 0.7 * plain


def test_search_scale_never_worse_than_plain_rounding_without_salient_channels():
    X = _salient_inputs(channels=0, seed=1)
    W = torch.randn(64, 128)
    found = awq.search_scale([W], awq.activation_scale(X), lambda ws: X @ ws[0].T, BITS, GROUP, sym=False)
    assert found.loss <= _mse(X, W, awq.fake_quantize(W, BITS, GROUP, False)) * (1 + 1e-5)


def test_search_scale_judges_the_whole_block():
    """Two weights reading one input, judged on a gated product (the MLP's shape): the block, not each linear."""
    X = _salient_inputs(tokens=512)
    Wg, Wu = torch.randn(48, 128), torch.randn(48, 128)
    calls = []

    def block(ws):
        calls.append(len(ws))
        return torch.nn.functional.silu(X @ ws[0].T) * (X @ ws[1].T)

    found = awq.search_scale([Wg, Wu], awq.activation_scale(X), block, BITS, GROUP, sym=False, grid=10)
    assert calls == [2] * 11  # the float reference, then one call per α
    assert found.loss < found.losses[0]


def test_gram_factor_keeps_the_mean_square_of_any_linear_output():
    X = _salient_inputs(tokens=2048, K=64)
    X[:, 5] = X[:, 4]  # a singular XᵀX still factors
    R = awq.gram_factor(X)
    assert R.shape == (64, 64)
    A = torch.randn(32, 64)
    assert float((R @ A.T).pow(2).mean()) == pytest.approx(float((X @ A.T).pow(2).mean()), rel=1e-4)
    few = torch.randn(16, 64)
    assert awq.gram_factor(few) is not None and torch.equal(awq.gram_factor(few), few)


@pytest.mark.parametrize("sym,gain", [(False, 0.99), (True, 0.95)])
def test_search_clip_lowers_output_error(sym, gain):
    """AutoAWQ's clamp to ±max_val trims only the larger side of an asymmetric range, hence the smaller gain there."""
    torch.manual_seed(0)
    W = torch.distributions.StudentT(2.5).sample((64, 128))  # heavy tails: min/max ranges wasted on outliers
    X = torch.randn(1024, 128)
    max_val = awq.search_clip(W, X, BITS, GROUP, sym)
    amax = W.reshape(64, -1, GROUP).abs().amax(-1)
    assert max_val.shape == (64, 128 // GROUP)
    assert (max_val <= amax).all() and (max_val >= 0.5 * amax - 1e-6).all()
    assert (max_val < amax).any()
    unclipped = awq.quantize_awq(W, BITS, GROUP, sym).dequantize()
    clipped = awq.quantize_awq(W, BITS, GROUP, sym, max_val).dequantize()
    assert _mse(X, W, clipped) < gain * _mse(X, W, unclipped)
    # The Gram factor stands for the tokens exactly.
    torch.testing.assert_close(awq.search_clip(W, awq.gram_factor(X), BITS, GROUP, sym), max_val)


def test_quantize_awq_codes_the_clipped_weight():
    W = torch.randn(16, 64)
    max_val = W.reshape(16, -1, GROUP).abs().amax(-1) * 0.8
    q = awq.quantize_awq(W, BITS, GROUP, False, max_val)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15 and q.zero.dtype == torch.int32
    expected = awq.fake_quantize(awq.clip_weight(W, max_val, GROUP), BITS, GROUP, False)
    torch.testing.assert_close(q.dequantize(), expected)


def test_relative_output_error_on_gram_factor_matches_tokens():
    X = _salient_inputs(tokens=512, K=64)
    W = torch.randn(32, 64)
    W_hat = awq.fake_quantize(W, BITS, GROUP, False)
    assert awq.relative_output_error(awq.gram_factor(X), W, W_hat) == pytest.approx(
        awq.relative_output_error(X, W, W_hat), rel=1e-4
    )


@pytest.mark.parametrize("norm_cls,offset", [(LlamaRMSNorm, 0.0), (GemmaRMSNorm, 1.0)])
def test_fold_scales_into_norm_divides_its_output(norm_cls, offset):
    norm = norm_cls(32)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = torch.randn(8, 32)
    s = torch.rand(32) * 4 + 0.25
    expected = norm(x) / s
    with torch.no_grad():
        norm.weight.copy_(awq.fold_scales_into_norm(norm.weight, s, offset))
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_fold_into_linear_rows_and_columns_keeps_the_pair():
    prev, nxt = torch.nn.Linear(24, 32, bias=True), torch.nn.Linear(32, 16)
    x = torch.randn(8, 24)
    s = torch.rand(32) * 4 + 0.25
    with torch.no_grad():
        before, expected = prev(x), nxt(prev(x))
        W, b = awq.fold_scales_into_linear_rows(prev.weight, prev.bias, s)
        prev.weight.copy_(W)
        prev.bias.copy_(b)
        nxt.weight.copy_(awq.scale_input_columns(nxt.weight, s))
        torch.testing.assert_close(prev(x) * s, before, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nxt(prev(x)), expected, rtol=1e-5, atol=1e-6)
