import itertools

import pytest
import torch

from toolkit.quant.gptq import HessianAccumulator, gptq_quantize
from toolkit.quant.primitives import (
    default_g_idx, dequantize, group_qparams, max_code, qparams_from_range, quantize_rtn,
)


def reference_gptq(W, H, bits, group_size, sym, damp, act_order=False, static_groups=True, ties=None):
    """Unbatched GPTQ straight from the paper, in float64: quantize one column, move the remaining weights by eq. 2,
    remove the column from the explicit inverse Hessian by eq. 3. No Cholesky, no lazy blocks.

    ties: codes [N, K] that settle exact rounding ties (w / scale within 1e-4 of a half-integer), which float32 and
    float64 break differently. They are systematic: a symmetric group's most negative weight sits at −2^(b−1) + ½.
    """
    N, K = W.shape
    size = K if group_size == -1 else group_size
    maxq = max_code(bits)
    W, H = W.double().clone(), H.double().clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(H.float().diagonal(), descending=True) if act_order else torch.arange(K)
    static = act_order and static_groups and group_size != -1
    if static:
        static_scale, static_zero = group_qparams(W.float(), bits, group_size, sym)
    H += damp * H.diagonal().mean() * torch.eye(K, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    codes = torch.zeros(N, K, dtype=torch.uint8)
    scales, zeros, g_idx = [], [], torch.zeros(K, dtype=torch.int32)
    loss = 0.0
    for t, j in enumerate(perm.tolist()):
        if static:
            scale, zero = static_scale[:, j // size].double(), static_zero[:, j // size].double()
            g_idx[j] = j // size
        else:
            if t % size == 0:
                cols = perm[t : t + size]
                scale, zero = qparams_from_range(W[:, cols].amin(1), W[:, cols].amax(1), bits, sym)
                scales.append(scale)
                zeros.append(zero)
            g_idx[j] = t // size
        x = W[:, j] / scale
        q = torch.round(x) + zero
        if ties is not None:
            tie = ((x - x.floor() - 0.5).abs() < 1e-4) & ((ties[:, j] - zero - x).abs() < 0.5 + 1e-4)
            q = torch.where(tie, ties[:, j].double(), q)
        q = torch.clamp(q, 0, maxq)
        err = W[:, j] - scale * (q - zero)
        loss += float((err**2).sum() / Hinv[j, j]) / 2
        W -= torch.outer(err / Hinv[j, j], Hinv[:, j])  # eq. 2
        Hinv -= torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]  # eq. 3
        codes[:, j] = q.to(torch.uint8)
    if static:
        scale, zero = static_scale, static_zero
    else:
        scale, zero = torch.stack(scales, 1).float(), torch.stack(zeros, 1)
    return codes, scale, zero.to(torch.int32), g_idx, loss


def correlated_inputs(tokens, K, seed=0):
    """Activations with a strongly non-identity covariance: a few shared directions plus per-channel scales."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, K // 8, generator=g) @ torch.randn(K // 8, K, generator=g)
    noise = 0.3 * torch.randn(tokens, K, generator=g)
    return (latent + noise) * torch.rand(K, generator=g).add_(0.2) * 3


def hessian(X):
    acc = HessianAccumulator(X.shape[1])
    acc.add(X)
    return acc.H


def output_error(W, Q, X):
    return float(((W - Q) @ X.T).norm())


def test_hessian_accumulator_is_a_running_mean_over_tokens():
    X = torch.randn(3, 40, 16, dtype=torch.float64)  # (batch, seq, K), any dtype
    acc = HessianAccumulator(16)
    acc.add(X[:1])
    acc.add(X[1:, :7])
    acc.add(X[1:, 7:].reshape(-1, 16))
    acc.add(torch.empty(0, 16))
    flat = X.reshape(-1, 16).float()
    assert acc.tokens == 120
    assert acc.H.dtype == torch.float32
    torch.testing.assert_close(acc.H, 2 / 120 * flat.T @ flat, rtol=1e-5, atol=1e-5)


def test_hessian_accumulator_lower_blocks_give_the_whole_symmetric_matrix():
    # K = 300 spans three block columns (128, 128, 44); H is read between adds, as a torchrun reduction would
    X = torch.randn(70, 300, dtype=torch.float64)
    acc = HessianAccumulator(300)
    acc.add(X[:30])
    torch.testing.assert_close(acc.H.double(), 2 / 30 * X[:30].T @ X[:30], rtol=1e-4, atol=1e-4)
    acc.add(X[30:])
    torch.testing.assert_close(acc.H.double(), 2 / 70 * X.T @ X, rtol=1e-4, atol=1e-4)
    assert torch.equal(acc.H[:128, 128:], acc.H[128:, :128].T)  # mirrored; diagonal blocks come from one product


@pytest.mark.parametrize(
    "group_size,block_size,act_order,static_groups,sym",
    [
        (16, 8, False, True, True),
        (32, 24, False, True, False),  # groups straddle lazy blocks
        (16, 24, True, False, True),
        (32, 24, True, False, False),
        (16, 8, True, True, False),
        (-1, 16, True, False, True),
        (-1, 40, False, True, False),
    ],
)
def test_matches_unbatched_reference(group_size, block_size, act_order, static_groups, sym):
    torch.manual_seed(1)
    W = torch.randn(16, 64)
    H = hessian(correlated_inputs(256, 64))
    qw, loss = gptq_quantize(W, H, 4, group_size, sym, block_size=block_size, act_order=act_order,
                             static_groups=static_groups)
    codes, scale, zero, g_idx, ref_loss = reference_gptq(
        W, H, 4, group_size, sym, 0.01, act_order, static_groups, ties=qw.codes
    )
    assert torch.equal(qw.codes, codes)
    assert torch.equal(qw.g_idx, g_idx)
    assert torch.equal(qw.zero, zero)
    torch.testing.assert_close(qw.scale, scale, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-3)


def test_beats_rtn_on_correlated_inputs():
    torch.manual_seed(0)
    W = torch.randn(64, 128) * 0.05
    X = correlated_inputs(1024, 128)
    qw, _ = gptq_quantize(W, hessian(X), 4, 32, True, block_size=32)
    rtn = quantize_rtn(W, 4, 32, True).dequantize()
    assert output_error(W, qw.dequantize(), X) < 0.6 * output_error(W, rtn, X)


def test_loss_is_the_mean_output_error():
    torch.manual_seed(0)
    W = torch.randn(32, 64)
    X = correlated_inputs(512, 64)
    qw, loss = gptq_quantize(W, hessian(X), 3, 32, False, damp=1e-4, block_size=16)
    assert loss == pytest.approx(output_error(W, qw.dequantize(), X) ** 2 / 512, rel=1e-2)


def test_act_order_without_static_groups_forms_groups_in_processing_order():
    torch.manual_seed(2)
    K, group_size = 128, 32
    W = torch.randn(24, K)
    X = correlated_inputs(512, K)
    H = hessian(X)
    qw, loss = gptq_quantize(W, H, 4, group_size, True, act_order=True, static_groups=False, block_size=48)
    perm = torch.argsort(H.diagonal(), descending=True)
    assert not torch.equal(qw.g_idx, default_g_idx(K, group_size))
    assert torch.equal(qw.g_idx[perm], default_g_idx(K, group_size))
    assert torch.bincount(qw.g_idx).tolist() == [group_size] * (K // group_size)
    assert qw.scale.shape == (24, K // group_size)
    deq = dequantize(qw.codes, qw.scale, qw.zero.float(), qw.g_idx)
    assert torch.equal(deq, qw.dequantize())
    # The records describe the weights the algorithm chose: their loss under the dampened H is the reported one.
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(K)
    delta = (W - deq).double()
    assert loss == pytest.approx(0.5 * float((delta @ Hd.double() * delta).sum()), rel=1e-3)


def test_static_groups_keep_the_original_grouping():
    torch.manual_seed(3)
    W = torch.randn(16, 64)
    H = hessian(correlated_inputs(256, 64))
    plain, _ = gptq_quantize(W, H, 4, 16, True)
    static, _ = gptq_quantize(W, H, 4, 16, True, act_order=True, static_groups=True)
    assert torch.equal(static.g_idx, plain.g_idx)
    assert torch.equal(static.g_idx, default_g_idx(64, 16))
    scale, zero = group_qparams(W, 4, 16, True)
    assert torch.equal(static.scale, scale) and torch.equal(static.zero, zero.int())


@pytest.mark.parametrize("act_order", [False, True])
def test_dead_inputs_give_zero_weights_and_no_nan(act_order):
    torch.manual_seed(4)
    W = torch.randn(8, 32)
    X = correlated_inputs(128, 32)
    X[:, [0, 5, 31]] = 0
    qw, loss = gptq_quantize(W, hessian(X), 4, 16, False, act_order=act_order, static_groups=False, block_size=8)
    deq = qw.dequantize()
    assert torch.isfinite(deq).all() and loss == loss
    assert torch.equal(deq[:, [0, 5, 31]], torch.zeros(8, 3))


def test_cholesky_failure_raises_damp_with_a_warning():
    W = torch.randn(8, 16)
    H = torch.ones(16, 16)  # rank 1: singular, and 1e-10 of dampening vanishes in float32
    with pytest.warns(UserWarning, match="raising damp to"):
        qw, loss = gptq_quantize(W, H, 4, 16, True, damp=1e-10)
    assert torch.isfinite(qw.dequantize()).all() and loss == loss


def test_non_finite_hessian_is_refused():
    H = torch.eye(16)
    H[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        gptq_quantize(torch.randn(4, 16), H, 4, 16, True)


def test_identity_hessian_is_round_to_nearest():
    torch.manual_seed(5)
    W = torch.randn(16, 64)
    for group_size, sym in [(16, True), (32, False), (-1, True)]:
        qw, _ = gptq_quantize(W, torch.eye(64), 4, group_size, sym, block_size=24)
        assert torch.equal(qw.codes, quantize_rtn(W, 4, group_size, sym).codes)


def test_mse_clip_lowers_the_importance_weighted_grid_error():
    torch.manual_seed(6)
    W = torch.distributions.StudentT(3.0).sample((32, 128))  # heavy tails: min/max wastes the grid on outliers
    importance = torch.rand(128).mul_(4).exp_()  # inputs' mean squares, 1 to 55: a diagonal Hessian
    importance[:8] = 0  # dead inputs count for nothing
    H = torch.diag(importance)
    plain, _ = gptq_quantize(W, H, 4, 32, False)
    clipped, _ = gptq_quantize(W, H, 4, 32, False, mse_clip=True)
    uniform, _ = gptq_quantize(W, torch.eye(128), 4, 32, False, mse_clip=True)
    assert not torch.equal(clipped.scale, plain.scale)
    assert not torch.equal(clipped.scale, uniform.scale)  # the weights steer the search

    def group_errors(qw):  # (N, G) Σ diag(H)·(w − q)² per group, what the search minimizes (a diagonal H: RTN codes)
        return ((W - qw.dequantize()).square() * importance).reshape(32, 4, 32).sum(-1)

    # Shrink factor 1 (min/max) is among the candidates, so no group gets worse; heavy-tailed ones get better.
    assert (group_errors(clipped) <= group_errors(plain) * (1 + 1e-5)).all()
    assert group_errors(clipped).sum() < 0.97 * group_errors(plain).sum()
    assert group_errors(clipped).sum() < group_errors(uniform).sum()
    X = correlated_inputs(512, 128)
    for static_groups in (True, False):
        qw, loss = gptq_quantize(W, hessian(X), 4, 32, False, mse_clip=True, act_order=True,
                                 static_groups=static_groups)
        assert output_error(W, qw.dequantize(), X) < output_error(W, quantize_rtn(W, 4, 32, False).dequantize(), X)


def test_per_channel():
    torch.manual_seed(7)
    W = torch.randn(16, 64)
    X = correlated_inputs(256, 64)
    qw, _ = gptq_quantize(W, hessian(X), 4, -1, True, act_order=True, block_size=16)
    assert qw.scale.shape == (16, 1) and torch.equal(qw.g_idx, torch.zeros(64, dtype=torch.int32))
    assert output_error(W, qw.dequantize(), X) < output_error(W, quantize_rtn(W, 4, -1, True).dequantize(), X)


@pytest.mark.parametrize("bits,sym", list(itertools.product(range(2, 9), (True, False))))
def test_every_width(bits, sym):
    torch.manual_seed(bits)
    W = torch.randn(16, 64)
    X = correlated_inputs(256, 64)
    qw, loss = gptq_quantize(W, hessian(X), bits, 32, sym, block_size=16)
    assert qw.codes.dtype == torch.uint8 and int(qw.codes.max()) <= max_code(bits)
    assert qw.scale.dtype == torch.float32 and qw.zero.dtype == torch.int32 and qw.g_idx.dtype == torch.int32
    assert loss > 0
    assert output_error(W, qw.dequantize(), X) < output_error(W, quantize_rtn(W, bits, 32, sym).dequantize(), X)


@pytest.mark.parametrize("act_order", [False, True])
def test_one_factor_serves_every_linear_of_a_group(act_order):
    """The driver factors a shared Hessian once for q/k/v (gate/up): quantizing with it leaves it unchanged, and
    each linear gets exactly what a factorization of its own gives; the Hessian itself is not modified."""
    from toolkit.quant.gptq import gptq_factored, hessian_factor

    X = correlated_inputs(256, 64, seed=3)
    H = hessian(X)
    before = H.clone()
    factor = hessian_factor(H, 0.01, act_order)
    kept = factor.reversed_inverse.clone()
    for seed in range(3):
        W = torch.randn(24 + 8 * seed, 64, generator=torch.Generator().manual_seed(seed))
        shared, shared_loss = gptq_factored(W, factor, 4, 16, False, block_size=24)
        own, own_loss = gptq_quantize(W, H, 4, 16, False, block_size=24, act_order=act_order)
        assert torch.equal(shared.codes, own.codes) and torch.equal(shared.scale, own.scale)
        assert torch.equal(shared.g_idx, own.g_idx) and shared_loss == own_loss
    assert torch.equal(factor.reversed_inverse, kept) and torch.equal(H, before)


def test_float_target_weights_are_the_least_squares_fit_to_the_float_outputs():
    """W* = W + W·D·(H + λI)⁻¹ is lstsq(X, X_f·Wᵀ) as λ → 0, and W itself where the inputs agree."""
    from toolkit.quant.gptq import CorrectionAccumulator, float_target_weights

    g = torch.Generator().manual_seed(4)
    X = torch.randn(600, 16, generator=g, dtype=torch.float64)
    X_float = X + 0.3 * torch.randn(600, 16, generator=g, dtype=torch.float64)
    W = torch.randn(8, 16, generator=g)
    H, D = HessianAccumulator(16), CorrectionAccumulator(16)
    for x, x_float in zip(X.split(250), X_float.split(250)):  # batches of any size add up to the whole
        H.add(x)
        D.add(x_float, x)
    torch.testing.assert_close(D.D.double(), 2 / 600 * (X_float - X).T @ X, rtol=1e-4, atol=1e-5)
    fitted = float_target_weights(W, D.D, H.H, damp=1e-9)
    best = torch.linalg.lstsq(X, X_float @ W.double().T).solution.T
    torch.testing.assert_close(fitted.double(), best, rtol=1e-3, atol=1e-3)
    assert torch.equal(float_target_weights(W, torch.zeros(16, 16), H.H), W)
