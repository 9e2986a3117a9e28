import pytest
import torch
from test_gptq import correlated_inputs, hessian

from toolkit.quant.gptq import dampened_, gptq_factored, hessian_factor
from toolkit.quant.primitives import GGUF_RULE, GPTQ_RULE
from toolkit.quant.refit import alternate, refit_scales

N, K, GROUP, DAMP = 24, 128, 32, 0.01
LAYOUTS = {"natural": (False, True), "act-order, static groups": (True, True),
           "act-order, dynamic groups": (True, False)}


def problem(seed=0):
    """(W [N, K], H [K, K]) of correlated inputs, and H dampened as GPTQ's loss measures it."""
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    H = hessian(correlated_inputs(512, K, seed))
    return W, H, dampened_(H.clone(), DAMP)


def gptq(W, H, act_order, static_groups, sym=False, rule=GPTQ_RULE, **kw):
    factor = hessian_factor(H, DAMP, act_order)
    return factor, *gptq_factored(W, factor, 4, GROUP, sym, static_groups=static_groups, rule=rule, **kw)


def reference_scales(record, W, H):
    """Per row, the explicit least-squares problem in float64: A [K, G] with A[k, g(k)] = code − zero, then
    s = (AᵀHA)⁻¹ AᵀHw."""
    H, G = H.double(), record.scale.shape[1]
    scales = []
    for r in range(W.shape[0]):
        A = torch.zeros(K, G, dtype=torch.float64)
        g = record.g_idx.long()
        A[torch.arange(K), g] = record.codes[r].double() - record.zero[r, g].double()
        scales.append(torch.linalg.solve(A.T @ H @ A, A.T @ H @ W[r].double()))
    return torch.stack(scales)


def loss(W, record, H):
    error = W.double() - record.dequantize().double()
    return 0.5 * float(((error @ H.double()) * error).sum())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refit_scales_solve_the_least_squares_problem_of_the_codes(layout):
    W, H, damped = problem()
    _, record, gptq_loss = gptq(W, H, *LAYOUTS[layout])
    refitted, refit_loss = refit_scales(record, W, damped)
    torch.testing.assert_close(refitted.scale.double(), reference_scales(record, W, damped), rtol=1e-4, atol=1e-6)
    assert torch.equal(refitted.codes, record.codes) and torch.equal(refitted.g_idx, record.g_idx)
    assert refit_loss == pytest.approx(loss(W, refitted, damped), rel=1e-4)
    assert gptq_loss == pytest.approx(loss(W, record, damped), rel=1e-3)  # the same objective GPTQ reports
    assert refit_loss < 0.99 * gptq_loss


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gptq_on_its_own_grid_gives_back_its_codes(layout):
    W, H, _ = problem(1)
    factor, record, _ = gptq(W, H, *LAYOUTS[layout])
    again, _ = gptq_factored(W, factor, 4, GROUP, False, grid=record)
    assert torch.equal(again.codes, record.codes) and torch.equal(again.g_idx, record.g_idx)
    assert torch.equal(again.scale, record.scale) and torch.equal(again.zero, record.zero)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alternate_keeps_the_refit_of_lowest_loss(layout):
    W, H, damped = problem(2)
    factor, record, gptq_loss = gptq(W, H, *LAYOUTS[layout])
    grids = []  # every refit alternate makes but its last

    def on_grid(grid):
        grids.append(grid)
        return gptq_factored(W, factor, 4, GROUP, False, grid=grid)[0]

    best, best_loss = alternate(record, W, damped, 2, on_grid)
    assert len(grids) == 2 and torch.equal(grids[0].scale, refit_scales(record, W, damped)[0].scale)
    last = refit_scales(gptq_factored(W, factor, 4, GROUP, False, grid=grids[-1])[0], W, damped)[0]
    assert best_loss == pytest.approx(min(loss(W, r, damped) for r in [*grids, last]), rel=1e-6)
    assert best_loss < 0.99 * gptq_loss


def test_a_group_on_its_zero_keeps_its_scale_and_gguf_scales_stay_fp16():
    W, H, damped = problem(3)
    W[:, :GROUP] = 0  # every row's first group: all codes on the zero point
    _, record, _ = gptq(W, H, False, True, sym=True, rule=GGUF_RULE)
    refitted, refit_loss = refit_scales(record, W, damped, GGUF_RULE)
    assert torch.equal(refitted.scale[:, 0], record.scale[:, 0]) and torch.isfinite(refitted.scale).all()
    assert torch.equal(refitted.scale, refitted.scale.half().float())
    assert refit_loss < loss(W, record, damped)
