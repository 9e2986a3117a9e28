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

Envelope: float32 throughout; K up to a few thousand (H is K×K); CPU or GPU. The grid is ``primitives``'s.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from toolkit.quant.primitives import QuantizedWeight, default_g_idx, max_code, qparams_from_range

# mse_clip: shrink factors of each group's [min, max] tried, and the error norm, as GPTQ's
# ``Quantizer.find_params(mse=True)`` (grid 100, norm 2.4), stopped at 0.8 of the range.
_SHRINK = [1 - i / 100 for i in range(21)]
_MSE_NORM = 2.4
# Automatic dampening stops here: a Hessian that needs more than its own mean diagonal is broken, not ill-conditioned.
_MAX_DAMP = 1.0


class HessianAccumulator:
    """H = 2/n Σ XᵀX over the n tokens seen so far, float32 [K, K]; a running mean, so batches of any size add up."""

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, X: torch.Tensor) -> None:
        """Fold in activations X [..., K] (flattened to [tokens, K])."""
        X = X.reshape(-1, X.shape[-1]).float()  # (tokens, K)
        total = self.tokens + X.shape[0]
        if total == self.tokens:
            return
        self.H.addmm_(X.T, X, beta=self.tokens / total, alpha=2 / total)
        self.tokens = total


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
) -> tuple[QuantizedWeight, float]:
    """Quantize ``W`` [N, K] against the Hessian ``H`` [K, K] (neither is modified). Returns the weight record, in
    original column order, and the loss Σ ½ (w − q)² / d².

    damp: added to diag(H), relative to its mean; multiplied by 10 (with a warning) until the Cholesky succeeds.
    Dead inputs (diag(H) = 0: never active) get H_kk = 1 and a zero weight column.
    act_order: columns in decreasing diag(H) order. Groups are then formed either in that order (``static_groups``
    False: non-monotonic g_idx, g_idx[perm[i]] = i // group_size) or, with ``static_groups``, fixed up front in
    original order from the whole W (g_idx stays k // group_size). Without act_order groups are already in original
    order and static_groups has no effect. Group qparams are otherwise taken when a group's first column is reached,
    from the error-updated weights at that moment; per-channel (group_size -1) qparams from the whole W.
    mse_clip: each group's range is shrunk to the factor with the lowest Σ|w − q|^2.4 instead of min/max.
    """
    N, K = W.shape
    if H.shape != (K, K):
        raise ValueError(f"H must be [{K}, {K}] for W of shape {tuple(W.shape)}, got {tuple(H.shape)}")
    size = K if group_size == -1 else group_size
    if K % size:
        raise ValueError(f"group_size {group_size} does not divide in_features {K}")
    if not torch.isfinite(H).all():
        raise ValueError("H holds NaN or infinite values; the calibration activations overflowed")
    maxq = max_code(bits)
    W = W.detach().float().clone()
    H = H.detach().float().clone()

    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1
    W[:, dead] = 0

    static = act_order and static_groups and group_size != -1
    if static:
        static_scale, static_zero = _qparams(W.reshape(N, K // size, size), bits, sym, mse_clip)  # (N, G)
        static_scale, static_zero = static_scale.T.contiguous(), static_zero.T.contiguous()  # (G, N)
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        group_of_column = (perm // size).tolist()
    Hinv = _inverse_cholesky(H, damp)  # (K, K) upper: row q is (H_F⁻¹)_{q,:} / d_q at step q
    del H
    d = Hinv.diagonal().clone()  # (K,)
    # Rows scaled to a unit diagonal: the updates then take the raw error w − q, with no division per column.
    Hinv.div_(d[:, None])

    # Transposed, so that a column of W is a contiguous row: every per-column update touches contiguous memory.
    Wt = W.T.contiguous()  # (K, N)
    del W
    codes_t = torch.empty_like(Wt)  # (K, N) codes as floats, in processing order
    scales, zeros = [], []  # per group in processing order, each (N,)
    loss = torch.zeros((), dtype=torch.float64, device=Wt.device)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = Wt[i1:i2]  # (count, N) view: updated in place, column by column
        Err1 = torch.empty_like(W1)  # (count, N) w − q of each column
        Hinv1 = Hinv[i1:i2, i1:i2]
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
                        pending = Wt[i2 : j + size] - Hinv[i1:j, i2 : j + size].T @ Err1[:i]
                        current = torch.cat([current, pending])  # (size, N)
                    scale, zero = _qparams(current.T, bits, sym, mse_clip)
                    scales.append(scale)
                    zeros.append(zero)
                w, q, err = W1[i], codes_t[j], Err1[i]
                torch.div(w, scale, out=q)
                q.round_().add_(zero).clamp_(0, maxq)
                torch.sub(q, zero, out=err)
                err.mul_(scale)  # dequantized value
                torch.sub(w, err, out=err)
                W1[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1)
            loss += Err1.div(d[i1:i2, None]).square_().sum(dtype=torch.float64)
        Wt[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)

    if static:
        scale, zero = static_scale.T, static_zero.T  # (N, G)
    else:
        scale, zero = torch.stack(scales, dim=1), torch.stack(zeros, dim=1)  # (N, G), groups in processing order
    g_idx = default_g_idx(K, group_size, Wt.device)
    if act_order:
        codes_t = codes_t[torch.argsort(perm)]  # (K, N) rows back in original column order
        if not static:
            g_idx[perm] = g_idx.clone()  # column perm[i] is the i-th processed: group i // group_size
    codes = codes_t.T.to(torch.uint8).contiguous()  # (N, K)
    record = QuantizedWeight(
        codes, scale.contiguous(), zero.to(torch.int32).contiguous(), g_idx, bits, group_size, sym
    )
    return record, 0.5 * loss.item()


def _qparams(groups: torch.Tensor, bits: int, sym: bool, mse_clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [...] of the groups [..., size]: min/max, or with ``mse_clip`` the best shrunk range."""
    xmin, xmax = groups.amin(dim=-1), groups.amax(dim=-1)
    if not mse_clip:
        return qparams_from_range(xmin, xmax, bits, sym)
    best = torch.full_like(xmin, float("inf"))
    scale, zero = torch.empty_like(xmin), torch.empty_like(xmin)
    for p in _SHRINK:
        s, z = qparams_from_range(p * xmin, p * xmax, bits, sym)
        q = torch.round(groups / s[..., None]).add_(z[..., None]).clamp_(0, max_code(bits))
        err = q.sub_(z[..., None]).mul_(s[..., None]).sub_(groups).abs_().pow_(_MSE_NORM).sum(dim=-1)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s, scale)
        zero = torch.where(better, z, zero)
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


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp·mean(diag H)·I)⁻¹, raising damp ×10 (with a warning) while it fails.

    With J the order reversal and J H J = L Lᵀ, H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J), so U = J L⁻¹ J: one Cholesky and one
    triangular solve, instead of the reference's Cholesky, ``cholesky_inverse`` and second Cholesky (LAPACK's
    ``potri`` is also the step that stalls for seconds when the CPU cores are shared).
    """
    K = H.shape[0]
    mean_diag = H.diagonal().mean()
    identity = torch.eye(K, dtype=H.dtype, device=H.device)
    while True:
        Hd = H.flip(0, 1)  # (K, K) J H J, a copy
        Hd.diagonal().add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            U = torch.linalg.solve_triangular(L, identity, upper=False).flip(0, 1)
            if torch.isfinite(U).all():
                return U
        if damp * 10 > _MAX_DAMP * (1 + 1e-9):
            raise ValueError(
                f"H is not positive definite even with damp {damp:g}; the calibration activations are degenerate"
            )
        damp *= 10
        warnings.warn(f"GPTQ: Cholesky of the dampened Hessian failed; raising damp to {damp:g}", stacklevel=3)
