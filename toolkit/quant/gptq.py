"""GPTQ (Frantar et al., arXiv 2210.17323): round one column at a time, pushing each rounding error onto the
columns not yet quantized so that the layer's output, not its weights, stays close.

Objective (eq. 1), independently for every output row of ``W`` [N, K], over calibration inputs X [tokens, K]:

    min_Q ‖W Xᵀ − Q Xᵀ‖²,    whose Hessian is H = 2 XᵀX (here 2/n XᵀX: a mean over the n tokens).

Quantizing column q to ``quant(w_q)`` and re-solving the rest optimally costs ½ (w_q − quant(w_q))² / [H_F⁻¹]_qq and
moves the unquantized weights by δ_F = −(w_q − quant(w_q)) / [H_F⁻¹]_qq · (H_F⁻¹)_{:,q} (eq. 2); H_F⁻¹ then loses
row and column q by one step of Gaussian elimination (eq. 3). GPTQ makes this fast by:
  * a fixed column order for every row (natural, or by decreasing diag(H) with ``act_order``), so all rows share
    one H_F⁻¹ sequence;
  * the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU, §4 "Step 3"): row q of U is exactly the
    (H_F⁻¹)_{q,:} / sqrt([H_F⁻¹]_qq) that eq. 2-3 need at step q, so the eliminations are never carried out;
  * lazy batches (eq. 4): the errors of ``block_size`` columns reach the rest of W in one matmul at block end.

The reported loss is Σ ½ (w − q)² / d² with d = U_qq (the reference's ``Losses``, halved as there). It equals
½ Σ_rows (W − Q) H (W − Q)ᵀ for the dampened H: ‖(W − Q) Xᵀ‖² / n, the mean over tokens of the squared output
error summed over rows, plus the dampening's small share.

Envelope: float32 throughout; K up to a few thousand (H is K×K; the factorization holds two K×K matrices at its
peak, the quantization loop one); CPU or GPU. The grid is ``primitives``'s, its scale by ``rule`` (GGUF's rounds
each group's scale to fp16 before the group's first column is rounded).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from toolkit.quant.finite import all_finite
from toolkit.quant.primitives import GPTQ_RULE, QuantizedWeight, ScaleRule, default_g_idx, max_code, qparams_from_range

# mse_clip: shrink factors of each group's [min, max] tried, as GPTQ's ``Quantizer.find_params(mse=True)`` (steps
# of 1/100), stopped at 0.8 of the range.
_SHRINK = [1 - i / 100 for i in range(21)]
# Automatic dampening stops here: a Hessian that needs more than its own mean diagonal is broken, not ill-conditioned.
_MAX_DAMP = 1.0
# Rows of the permuted Hessian gathered per step: the gather's temporaries stay small next to the K×K result.
_GATHER_ROWS = 512
# Narrowest block column of the Hessian's lower trapezoid: narrower products lose more to matmul overheads than the
# triangle saves.
_BLOCK_COLUMNS = 128


class HessianAccumulator:
    """H = 2/n Σ XᵀX over the n tokens seen so far, float32 [K, K]; a running mean, so batches of any size add up.

    H is symmetric, so ``add`` only updates the lower block trapezoid (block columns of ``_BLOCK_COLUMNS`` or K/8
    columns, whichever is wider: about 0.6 of a full XᵀX's work) and ``H`` mirrors it when read.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self._sums = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._block = max(_BLOCK_COLUMNS, -(-in_features // 8))
        self.tokens = 0

    def add(self, X: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Fold in activations X [..., K] (flattened to [tokens, K]); ``weights`` [tokens]: each token's xxᵀ counts
        weights² times (a token whose output error the model scales by w)."""
        X = X.reshape(-1, X.shape[-1]).float()  # (tokens, K)
        if weights is not None:
            X = X * weights.reshape(-1, 1).to(X)
        total = self.tokens + X.shape[0]
        if total == self.tokens:
            return
        K = X.shape[1]
        for j in range(0, K, self._block):  # block column j: rows j.. of columns j..j+block
            self._sums[j:, j : j + self._block].addmm_(X[:, j:].T, X[:, j : j + self._block],
                                                       beta=self.tokens / total, alpha=2 / total)
        self.tokens = total

    @property
    def H(self) -> torch.Tensor:
        """The Hessian [K, K], symmetric (the accumulator's own storage: later ``add`` calls change it)."""
        K = self._sums.shape[0]
        for j in range(0, K - self._block, self._block):  # the blocks above the diagonal, from those below it
            self._sums[j : j + self._block, j + self._block :] = self._sums[j + self._block :, j : j + self._block].T
        return self._sums


class CorrectionAccumulator:
    """D = 2/n Σ (X_f − X)ᵀX over the n tokens seen so far, float32 [K, K]: X the inputs a linear reads on the
    quantized model's activations, X_f what it reads on the float model's, token for token (a running mean on
    ``HessianAccumulator``'s scale). With H, ``float_target_weights`` turns W into the weights GPTQ should fit."""

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.D = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, X_float: torch.Tensor, X: torch.Tensor) -> None:
        """Fold in one batch: the float model's inputs and the quantized model's, both [..., K], the same tokens."""
        X = X.reshape(-1, X.shape[-1]).float()
        X_float = X_float.reshape(X.shape).float()
        total = self.tokens + X.shape[0]
        if total == self.tokens:
            return
        self.D.mul_(self.tokens / total).addmm_((X_float - X).T, X, alpha=2 / total)
        self.tokens = total


def float_target_weights(W: torch.Tensor, D: torch.Tensor, H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """W* = W + W·D·(H + λI)⁻¹ [N, K] float32: the least-squares weights whose outputs on the quantized model's inputs
    are closest to W's on the float model's (GPTAQ's objective: Li et al. 2025, GPTQModel's ``gptaq``). Since ‖X·Qᵀ − X_f·Wᵀ‖² =
    ‖X·(Q − W*)ᵀ‖² + a constant, GPTQ on W* minimises it: only the weights it fits change. λ = ``damp`` × mean
    diag(H), as GPTQ dampens; W* = W where the two inputs agree (D = 0)."""
    damped = dampened_(H.float().clone(), damp)
    return W.float() + torch.linalg.solve(damped, (W.float() @ D).T).T  # H symmetric: (W·D·H⁻¹)ᵀ = H⁻¹·(W·D)ᵀ


def dampened_(H: torch.Tensor, damp: float) -> torch.Tensor:
    """``H`` [K, K] dampened in place as ``hessian_factor`` dampens it (dead inputs' zero diagonal set to 1, then
    ``damp`` × the mean diagonal added), and returned: the Hessian GPTQ's loss is measured with."""
    diagonal = H.diagonal()
    diagonal.copy_(torch.where(diagonal == 0, torch.ones_like(diagonal), diagonal))
    diagonal.add_(damp * diagonal.mean())
    return H


@dataclass
class HessianFactor:
    """What GPTQ needs of a Hessian, shared by every linear that reads the same input (q/k/v; gate/up).

    U (upper, the Cholesky factor of the dampened H⁻¹ in processing order) is kept as ``reversed_inverse`` = J U J
    (lower; J the order reversal), the form the factorization yields, and read one block of rows at a time
    (``rows``), so no flipped K×K copy is ever made.
    """

    reversed_inverse: torch.Tensor  # (K, K) lower: J U J
    diagonal: torch.Tensor  # (K,) d = diag(U), in processing order
    dead: torch.Tensor  # (K,) bool: inputs never active (diag H = 0), in original order
    importance: torch.Tensor  # (K,) diag(H) undampened, in original order: each input's mean square (0 when dead)
    perm: torch.Tensor | None  # (K,) processing order (act_order), or None for the natural order

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of U, scaled to a unit diagonal: [stop - start, K], a new tensor."""
        K = self.reversed_inverse.shape[0]
        block = self.reversed_inverse[K - stop : K - start].flip(0, 1)
        return block.div_(self.diagonal[start:stop, None])


def hessian_factor(H: torch.Tensor, damp: float = 0.01, act_order: bool = False) -> HessianFactor:
    """Factor the Hessian ``H`` [K, K] for ``gptq_factored``; ``H`` is left unchanged.

    damp: added to diag(H), relative to its mean; multiplied by 10 (with a warning) until the factorization
    succeeds. Dead inputs (diag(H) = 0) are treated as H_kk = 1. act_order: columns in decreasing diag(H) order.

    With J H J = L Lᵀ, H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), so U = J L⁻¹ J: one Cholesky and one triangular solve, instead of
    the reference's Cholesky, ``cholesky_inverse`` and second Cholesky (LAPACK's ``potri`` is also the step that
    stalls for seconds when the CPU cores are shared). Peak memory: two K×K float32 matrices besides ``H``; pass a
    Hessian nothing else holds and it is freed as soon as its permuted copy exists, so two in all. The steps are
    inline on purpose: a helper's argument would keep its matrix alive until the helper returns.
    """
    K = H.shape[0]
    if H.shape != (K, K):
        raise ValueError(f"H must be square, got {tuple(H.shape)}")
    if not all_finite(H):
        raise ValueError("H holds NaN or infinite values; the calibration activations overflowed")
    diagonal = H.diagonal().float().clone()  # not a view: H must be freeable below
    dead = diagonal == 0
    importance = diagonal.clone()
    diagonal = torch.where(dead, torch.ones_like(diagonal), diagonal)
    perm = torch.argsort(diagonal, descending=True) if act_order else None
    order = (perm if perm is not None else torch.arange(K, device=H.device)).flip(0)
    reversed_h = torch.empty(K, K, dtype=torch.float32, device=H.device)  # J P H Pᵀ J, gathered in row blocks
    for start in range(0, K, _GATHER_ROWS):
        rows = order[start : start + _GATHER_ROWS]
        reversed_h[start : start + len(rows)] = H.index_select(0, rows).index_select(1, order)
    del H
    reversed_h.diagonal().copy_(diagonal[order])
    mean_diag, added = diagonal.mean(), 0.0
    while True:
        reversed_h.diagonal().add_((damp - added) * mean_diag)
        added = damp
        L, info = torch.linalg.cholesky_ex(reversed_h)
        if info == 0:
            del reversed_h  # rebuilt from L in the rare case that L⁻¹ overflows
            reversed_inverse = torch.eye(K, dtype=L.dtype, device=L.device)  # L⁻¹ is solved into its storage
            torch.linalg.solve_triangular(L, reversed_inverse, upper=False, out=reversed_inverse)
            if all_finite(reversed_inverse):
                return HessianFactor(reversed_inverse, reversed_inverse.diagonal().flip(0), dead, importance, perm)
            del reversed_inverse
            reversed_h = L @ L.mT
        del L
        damp = _raised_damp(damp)


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = True,
    mse_clip: bool = False,
    rule: ScaleRule = GPTQ_RULE,
) -> tuple[QuantizedWeight, float]:
    """Quantize ``W`` [N, K] against the Hessian ``H`` [K, K] (neither is modified): ``hessian_factor`` then
    ``gptq_factored``. Returns the weight record, in original column order, and the loss Σ ½ (w − q)² / d²."""
    if H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"H must be [{W.shape[1]}, {W.shape[1]}] for W of shape {tuple(W.shape)}, "
                         f"got {tuple(H.shape)}")
    factor = hessian_factor(H, damp, act_order)
    return gptq_factored(W, factor, bits, group_size, sym, block_size=block_size, static_groups=static_groups,
                         mse_clip=mse_clip, rule=rule)


def gptq_factored(
    W: torch.Tensor,
    factor: HessianFactor,
    bits: int,
    group_size: int,
    sym: bool,
    *,
    block_size: int = 128,
    static_groups: bool = True,
    mse_clip: bool = False,
    rule: ScaleRule = GPTQ_RULE,
    grid: QuantizedWeight | None = None,
) -> tuple[QuantizedWeight, float]:
    """Quantize ``W`` [N, K] (not modified) with a ``hessian_factor`` of its Hessian. Returns the weight record, in
    original column order, and the loss Σ ½ (w − q)² / d².

    Dead inputs get a zero weight column. With the factor's act_order, groups are formed either in processing order
    (``static_groups`` False: non-monotonic g_idx, g_idx[perm[i]] = i // group_size) or, with ``static_groups``,
    fixed up front in original order from the whole W (g_idx stays k // group_size). Without act_order groups are
    already in original order and static_groups has no effect. Group qparams are otherwise taken when a group's
    first column is reached, from the error-updated weights at that moment; per-channel (group_size -1) qparams
    from the whole W.
    mse_clip: each group's range is shrunk to the factor with the lowest Σ diag(H)·(w − q)², the group's rounding
    error weighted by each input's mean square (llama.cpp's importance matrix), instead of min/max.
    rule: how a range becomes a scale (``primitives.ScaleRule``).
    grid: choose the codes on this record's scales, zeros and groups (``refit.refit_scales``'s) instead of taking
    qparams from ranges; the record keeps its g_idx. A record of this factor's own run gives back its codes.
    """
    N, K = W.shape
    if factor.diagonal.shape[0] != K:
        raise ValueError(f"the Hessian factor is for {factor.diagonal.shape[0]} inputs, W has {K}")
    size = K if group_size == -1 else group_size
    if K % size:
        raise ValueError(f"group_size {group_size} does not divide in_features {K}")
    maxq = max_code(bits)
    perm, d = factor.perm, factor.diagonal
    act_order = perm is not None
    # Transposed, so that a column of W is a contiguous row: every per-column update touches contiguous memory.
    Wt = W.detach().T.float().contiguous()  # (K, N), a copy
    Wt[factor.dead] = 0

    static = grid is not None or (act_order and static_groups and group_size != -1)
    if grid is not None:
        static_scale, static_zero = grid.scale.T.float().contiguous(), grid.zero.T.float().contiguous()  # (G, N)
    elif static:
        static_scale, static_zero = _qparams(Wt.T.reshape(N, K // size, size), bits, sym, rule,
                                             factor.importance.reshape(K // size, size) if mse_clip else None)  # (N, G)
        static_scale, static_zero = static_scale.T.contiguous(), static_zero.T.contiguous()  # (G, N)
    importance = factor.importance
    groups = grid.g_idx.long() if grid is not None else torch.arange(K, device=Wt.device) // size  # static groups
    if act_order:
        Wt = Wt[perm]
        importance = importance[perm]
        groups = groups[perm]
    group_of_column = groups.tolist()  # in processing order

    codes_t = torch.empty(K, N, dtype=torch.uint8, device=Wt.device)  # (K, N) in processing order
    q = torch.empty(N, dtype=torch.float32, device=Wt.device)  # one column's codes as floats
    scales, zeros = [], []  # per group in processing order, each (N,)
    loss = torch.zeros((), dtype=torch.float64, device=Wt.device)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        U = factor.rows(i1, i2)  # (count, K): rows i1..i2-1 of the unit-diagonal factor
        W1 = Wt[i1:i2]  # (count, N) view: updated in place, column by column
        Err1 = torch.empty_like(W1)  # (count, N) w − q of each column
        U1 = U[:, i1:i2]
        with _single_threaded(Wt.device):
            for i in range(i2 - i1):
                j = i1 + i
                if static:
                    g = group_of_column[j]
                    scale, zero = static_scale[g], static_zero[g]
                elif j % size == 0:
                    # The group's weights as they stand now: this block's rows are current, later rows still owe the
                    # updates of this block's columns 0..i-1.
                    current = W1[i : i + size]
                    if j + size > i2:
                        pending = Wt[i2 : j + size] - U[:i, i2 : j + size].T @ Err1[:i]
                        current = torch.cat([current, pending])  # (size, N)
                    scale, zero = _qparams(current.T, bits, sym, rule, importance[j : j + size] if mse_clip else None)
                    scales.append(scale)
                    zeros.append(zero)
                w, err = W1[i], Err1[i]
                torch.div(w, scale, out=q)
                q.round_().add_(zero).clamp_(0, maxq)
                codes_t[j].copy_(q)
                torch.sub(q, zero, out=err)
                err.mul_(scale)  # dequantized value
                torch.sub(w, err, out=err)
                W1[i + 1 :].addr_(U1[i, i + 1 :], err, alpha=-1)
            loss += Err1.div(d[i1:i2, None]).square_().sum(dtype=torch.float64)
        Wt[i2:].addmm_(U[:, i2:].T, Err1, alpha=-1)
    del Wt

    if static:
        scale, zero = static_scale.T, static_zero.T  # (N, G)
    else:
        scale, zero = torch.stack(scales, dim=1), torch.stack(zeros, dim=1)  # (N, G), groups in processing order
    g_idx = default_g_idx(K, group_size, codes_t.device) if grid is None else grid.g_idx.clone()
    if act_order:
        codes_t = codes_t[torch.argsort(perm)]  # (K, N) rows back in original column order
        if not static:
            g_idx[perm] = g_idx.clone()  # column perm[i] is the i-th processed: group i // group_size
    codes = codes_t.T.contiguous()  # (N, K)
    record = QuantizedWeight(
        codes, scale.contiguous(), zero.to(torch.int32).contiguous(), g_idx, bits, group_size, sym
    )
    return record, 0.5 * loss.item()


def _qparams(groups: torch.Tensor, bits: int, sym: bool, rule: ScaleRule,
             importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [...] of the groups [..., size]: min/max, or, given each column's ``importance`` (broadcast
    against the groups), the clipped range with the lowest importance-weighted squared rounding error: both ends
    shrunk by one factor, then (asymmetric grids) the minimum alone, then the maximum alone."""
    xmin, xmax = groups.amin(dim=-1), groups.amax(dim=-1)
    if importance is None:
        return qparams_from_range(xmin, xmax, bits, sym, rule)
    best = torch.full_like(xmin, float("inf"))
    scale, zero = torch.empty_like(xmin), torch.empty_like(xmin)
    low, high = xmin, xmax

    def search(ranges):
        nonlocal best, scale, zero, low, high
        for lo, hi in ranges:
            s, z = qparams_from_range(lo, hi, bits, sym, rule)
            q = torch.round(groups / s[..., None]).add_(z[..., None]).clamp_(0, max_code(bits))
            err = q.sub_(z[..., None]).mul_(s[..., None]).sub_(groups).square_().mul_(importance).sum(dim=-1)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
            low, high = torch.where(better, lo, low), torch.where(better, hi, high)

    search((p * xmin, p * xmax) for p in _SHRINK)
    if not sym:
        fixed_high = high
        search((p * xmin, fixed_high) for p in _SHRINK)
        fixed_low = low
        search((fixed_low, p * xmax) for p in _SHRINK)
    return scale, zero


@contextmanager
def _single_threaded(device: torch.device):
    """One intra-op thread on the CPU for the column loop: its ~10 small ops per column gain nothing from OpenMP,
    whose fork/join stalls for milliseconds per op when the cores are shared (measured on 2 busy cores, K = 1536:
    0.25 s single-threaded, 5-20 s with 2 threads). The block matmuls and the Cholesky stay multi-threaded."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _raised_damp(damp: float) -> float:
    """The next dampening after a failed factorization (×10, with a warning), or an error past ``_MAX_DAMP``."""
    if damp * 10 > _MAX_DAMP * (1 + 1e-9):
        raise ValueError(f"H is not positive definite even with damp {damp:g}; the calibration activations are "
                         "degenerate")
    warnings.warn(f"GPTQ: Cholesky of the dampened Hessian failed; raising damp to {damp * 10:g}", stacklevel=3)
    return damp * 10
