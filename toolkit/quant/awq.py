"""Activation-aware weight quantization (AWQ, Lin et al., arXiv 2306.00978): the math, tensors in and tensors out.

Scaling (§3.2). The linears W_i [N_i, K] of one group read the same activations X [T, K], the output of a preceding
module P (a norm, or a linear such as v_proj). Multiplying input column k of every W_i by s_k and dividing P's output
channel k by s_k leaves the float block unchanged, but gives the salient channels (large mean |x|) a finer grid
relative to their weights. With s_x = mean over tokens of |X| (per input channel, [K]) AWQ picks

    s(α) = s_x^α / sqrt(max(s_x^α) · min(s_x^α)),      α ∈ {0, 1/n, …, (n−1)/n}   (n = ``grid``)
    α*   = argmin_α  ‖ f(Q(W·diag(s)) · diag(s)⁻¹) − f(W) ‖²

where f is the block that reads the group's outputs (the attention block for q/k/v, the MLP for gate/up, the linear
itself for o and down), f(W) the float block, and Q the group-wise min/max quantizer of ``toolkit.quant.primitives``
(asymmetric by default: scale = (max − min)/(2^bits − 1), zero = round(−min/scale)). Q(W·s)·s⁻¹ applied to X is the
folded model's Q(W·s) applied to X·s⁻¹. The normalisation only centres s around 1 (AutoAWQ does the same); α = 0 is
plain round-to-nearest.

Clipping (llm-awq ``auto_clip``, AutoAWQ ``_search_best_clip``). After scaling, per (output row, group): shrink
the largest magnitude to max_val = amax·(1 − i/n_grid), i < max_shrink·n_grid, clamp the group to [−max_val, max_val],
and keep the shrink with the lowest squared error of the group's partial output Σ_{k∈group} x_k·w_k over the tokens.
That error is the quadratic form Δw_g · X_gᵀX_g · Δw_gᵀ, so it is computed through each group's Gram block: every
token counts, at a cost of N·K·group_size per shrink, with no token subsample and no [N, T, G] tensor.

Folding: a norm computing x̂·(offset + w) gets w' = (offset + w)/s − offset (Gemma: offset 1); a preceding linear
gets its output rows and bias divided by s; the group's input columns are multiplied by s.

Envelope: tested in float32 on random matrices and on tiny random Llama / Gemma layers (tests/quant/test_awq.py,
tests/methods/test_awq_driver.py). Losses, Gram matrices and fake-quantized weights are float32 whatever the model
dtype; a block passed to ``search_scale`` runs in whatever dtype its caller chooses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from toolkit.quant.primitives import GPTQ_RULE, QuantizedWeight, ScaleRule, max_code, qparams_from_range, quantize_rtn


def activation_scale(X: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
    """s_x: mean |x| per input channel → [K], from one tensor [..., K] or accumulated over a stream of them."""
    total, count = None, 0
    for x in [X] if isinstance(X, torch.Tensor) else X:
        x = x.reshape(-1, x.shape[-1])  # (tokens, K)
        part = x.float().abs().sum(dim=0)
        total = part if total is None else total + part
        count += x.shape[0]
    if total is None:
        raise ValueError("activation_scale needs at least one activation tensor")
    return total / count


def candidate_scales(x_mean: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The search grid: α [grid] = i/grid, and s(α) [grid, K] normalised so that sqrt(max·min) = 1."""
    alphas = torch.arange(grid, dtype=torch.float32, device=x_mean.device) / grid
    s = x_mean.float()[None, :].pow(alphas[:, None]).clamp(min=1e-4)  # (grid, K); 0^0 = 1 keeps α = 0 exact
    s = s / (s.amax(dim=1, keepdim=True) * s.amin(dim=1, keepdim=True)).sqrt()
    return alphas, s


def fake_quantize(
    W: torch.Tensor, bits: int, group_size: int, sym: bool, rule: ScaleRule = GPTQ_RULE
) -> torch.Tensor:
    """Q(W): W [..., N, K] rounded onto its own per-(row, group) min/max grid and dequantized, float32.

    The same numbers as ``quantize_rtn(W).dequantize()``, computed on a [rows, G, group_size] view (no g_idx gather,
    no uint8 round trip), since the searches call it for every candidate of every group."""
    K = W.shape[-1]
    size = K if group_size == -1 else group_size
    Wg = W.float().reshape(-1, K // size, size)  # (rows, G, group_size)
    scale, zero = qparams_from_range(Wg.amin(dim=-1), Wg.amax(dim=-1), bits, sym, rule)  # (rows, G)
    scale, zero = scale[..., None], zero[..., None]
    # One allocation, then in place: code = clamp(round(W/scale) + zero), Ŵ = (code − zero)·scale.
    out = torch.div(Wg, scale).round_().add_(zero).clamp_(0, max_code(bits)).sub_(zero).mul_(scale)
    return out.reshape(W.shape)


@dataclass
class ScaleSearch:
    """Outcome of ``search_scale``: the chosen scales [K], its α, its loss, and the loss of every α [grid]."""

    scales: torch.Tensor
    alpha: float
    loss: float
    losses: torch.Tensor


def search_scale(
    weights: Sequence[torch.Tensor],
    x_mean: torch.Tensor,
    block_output: Callable[[list[torch.Tensor]], torch.Tensor],
    bits: int,
    group_size: int,
    sym: bool,
    grid: int = 20,
    rule: ScaleRule = GPTQ_RULE,
) -> ScaleSearch:
    """Grid-search α for one scaling group.

    weights: the group's float weights [N_i, K], all reading the same input. x_mean: ``activation_scale`` of that
    input [K]. block_output(ws): the block's output (any shape, same every call) with ws in place of the weights;
    called once with the float weights for the reference, then once per α with Q(W·s)·s⁻¹.
    Loss: mean squared difference to the float block output. rule: the grid's scale rule (``ScaleRule``).
    """
    float_weights = [W.float() for W in weights]
    reference = block_output(float_weights).float()
    alphas, candidates = candidate_scales(x_mean, grid)
    losses = torch.full((grid,), float("inf"))
    for i, s in enumerate(candidates):
        trial = [fake_quantize(W * s, bits, group_size, sym, rule).div_(s) for W in float_weights]
        loss = float(torch.nn.functional.mse_loss(block_output(trial).float(), reference))
        if math.isfinite(loss):
            losses[i] = loss
    if not torch.isfinite(losses).any():
        raise FloatingPointError("every AWQ scaling candidate gave a non-finite block output; check the activations")
    best = int(losses.argmin())
    return ScaleSearch(candidates[best].clone(), float(alphas[best]), float(losses[best]), losses)


def gram_factor(X: torch.Tensor) -> torch.Tensor:
    """K pseudo-tokens R [K, K] with RᵀR/K = XᵀX/T, so that R·Aᵀ has the same mean square as X·Aᵀ for every A [N, K].

    Any error of a linear on X (``search_scale`` on o/down, ``search_clip``, relative output error) then costs K rows
    instead of T. Returns X (float32) itself when T ≤ K. A tiny diagonal jitter is added only if XᵀX is singular.
    """
    X = X.reshape(-1, X.shape[-1]).float()  # (T, K)
    T, K = X.shape
    if T <= K:
        return X
    gram = (X.T @ X).double() / T  # (K, K)
    jitter = 0.0
    base = float(gram.diagonal().mean().clamp_min(1e-30))
    eye = torch.eye(K, dtype=gram.dtype, device=gram.device)
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if int(info) == 0:
            return (L.T * math.sqrt(K)).float()  # (K, K), upper triangular
        jitter = base * 1e-9 if jitter == 0 else jitter * 100
    raise FloatingPointError("XᵀX of the calibration activations is not positive semi-definite (NaN inputs?)")


def search_clip(
    W: torch.Tensor,
    X: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    rule: ScaleRule = GPTQ_RULE,
) -> torch.Tensor:
    """max_val [N, G] per (output row, group) minimising the group's partial-output error on tokens X [T, K]."""
    N, K = W.shape
    size = K if group_size == -1 else group_size
    G = K // size
    Xg = X.reshape(-1, G, size).float().transpose(0, 1)  # (G, T, size)
    gram = Xg.transpose(1, 2) @ Xg  # (G, size, size)
    Wg = W.float().reshape(N, G, size)
    amax = Wg.abs().amax(dim=-1)  # (N, G)
    best_err = torch.full_like(amax, float("inf"))
    best_max = amax.clone()
    for i in range(max(1, int(max_shrink * n_grid))):
        max_val = amax * (1 - i / n_grid)
        clipped = torch.clamp(Wg, -max_val[..., None], max_val[..., None])
        delta = fake_quantize(clipped.reshape(N, K), bits, group_size, sym, rule).reshape(N, G, size) - Wg
        delta_t = delta.transpose(0, 1)  # (G, N, size)
        err = ((delta_t @ gram) * delta_t).sum(dim=-1).T  # (N, G): Δw_g · X_gᵀX_g · Δw_gᵀ
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def clip_weight(W: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] clamped to [−max_val, max_val] per (row, group), max_val [N, G]."""
    N, K = W.shape
    size = K if group_size == -1 else group_size
    Wg = W.reshape(N, K // size, size)  # (N, G, size)
    bound = max_val.to(W.dtype)[..., None]
    return torch.clamp(Wg, -bound, bound).reshape(N, K)


def quantize_awq(
    W: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    max_val: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    rule: ScaleRule = GPTQ_RULE,
) -> QuantizedWeight:
    """Codes of the (already scaled) W [N, K], clamped to ``max_val`` [N, G] first when given, on min/max groups."""
    W = W.float()
    if max_val is not None:
        W = clip_weight(W, max_val, group_size)
    return quantize_rtn(W, bits, group_size, sym, bias, rule)


def relative_output_error(X: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor) -> float:
    """‖X(Ŵ − W)ᵀ‖ / ‖XWᵀ‖ on tokens X [T, K] (or their ``gram_factor``)."""
    X = X.float()
    reference = X @ W.float().T
    return float((X @ (W_hat.float() - W.float()).T).norm() / reference.norm().clamp_min(1e-12))


def fold_scales_into_norm(norm_weight: torch.Tensor, scales: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """Weight [K] of a norm computing x̂·(offset + w) whose output is divided by ``scales`` [K]:
    (offset + w)/s − offset."""
    return ((offset + norm_weight.float()) / scales.float() - offset).to(norm_weight.dtype)


def fold_scales_into_linear_rows(
    prev_weight: torch.Tensor, prev_bias: torch.Tensor | None, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight [K, K_in] and bias [K] of a preceding linear whose output is divided by ``scales`` [K]."""
    s = scales.float()
    weight = (prev_weight.float() / s[:, None]).to(prev_weight.dtype)
    bias = None if prev_bias is None else (prev_bias.float() / s).to(prev_bias.dtype)
    return weight, bias


def scale_input_columns(W: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W·diag(s): the weight [N, K] of a linear whose input is divided by ``scales`` [K]."""
    return (W.float() * scales.float()[None, :]).to(W.dtype)
