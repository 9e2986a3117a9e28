"""Scale refit: the group scales that make the layer's output closest for codes already chosen.

With the codes c and integer zeros z of a ``QuantizedWeight`` fixed, every dequantized weight ŵ_k = s_{g(k)} (c_k − z_g)
is linear in the group scales s, so GPTQ's objective for one output row w [K],

    (w − ŵ) H (w − ŵ)ᵀ,    H the layer's (dampened) Hessian [K, K],

is a quadratic in s [G] with its minimum at the solution of M s = b, where, with d_k = c_k − z_{g(k)},

    M_gh = Σ_{k∈g, j∈h} d_k H_kj d_j,    b_g = Σ_{k∈g} d_k (H wᵀ)_k.

GPTQ takes each group's scale from a range before it chooses the codes, and then compensates every rounding error on
that fixed grid; the refit solves for the grid after the fact (SignRound learns scales and rounding together by
gradient, AutoRound's ``min_max`` learning rate; here one G×G solve per row). ``alternate`` repeats the two
(``GPTQConfig.refit_rounds``): codes chosen again on the refitted grid, then the grid refitted to those codes. A
refit never raises the objective; GPTQ's greedy choice of codes on a given grid can, so the lowest refit is kept.
M costs one [N, size] × [size, K] product per group: N·K² multiply-adds per linear, as one GPTQ pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from toolkit.quant.primitives import GPTQ_RULE, QuantizedWeight, ScaleRule


def refit_scales(record: QuantizedWeight, W: torch.Tensor, H: torch.Tensor,
                 rule: ScaleRule = GPTQ_RULE) -> tuple[QuantizedWeight, float]:
    """``record`` with each row's group scales re-solved for its codes against ``W`` [N, K] under ``H`` [K, K] (see
    the module docstring; ``rule.dtype`` rounds them as the format stores them). A group whose codes all sit on its
    zero keeps its scale (it reproduces zeros with any). Returns (the record, ½ Σ_rows (W − Ŵ) H (W − Ŵ)ᵀ), the loss
    GPTQ reports for the same H."""
    N, K = W.shape
    G = record.scale.shape[1]
    size = K // G
    g_idx = record.g_idx.long()
    order = torch.argsort(g_idx, stable=True)  # columns by group (act-order's dynamic groups are not contiguous)
    d = (record.codes.float() - record.zero.float()[:, g_idx])[:, order]  # (N, K), grouped
    target = W.float()[:, order]
    H = H[order][:, order] if not torch.equal(order, torch.arange(K, device=order.device)) else H
    M = torch.empty(N, G, G, dtype=torch.float32, device=W.device)
    for h in range(G):
        columns = slice(h * size, (h + 1) * size)
        M[:, :, h] = (d * (d[:, columns] @ H[columns])).view(N, G, size).sum(-1)
    b = (d * (target @ H)).view(N, G, size).sum(-1)
    unused = M.diagonal(dim1=1, dim2=2) <= 0  # (N, G): every code of the group on its zero
    M.diagonal(dim1=1, dim2=2).masked_fill_(unused, 1.0)
    scale = torch.linalg.solve(M, torch.where(unused, record.scale.float(), b))
    if rule.dtype is not None:
        scale = scale.to(rule.dtype).float()
    error = target - d * scale.repeat_interleave(size, dim=1)
    return replace(record, scale=scale.contiguous()), 0.5 * float(((error @ H) * error).sum())


def alternate(record: QuantizedWeight, W: torch.Tensor, H: torch.Tensor, rounds: int,
              choose_codes: Callable[[QuantizedWeight], QuantizedWeight],
              rule: ScaleRule = GPTQ_RULE) -> tuple[QuantizedWeight, float]:
    """``rounds`` times: refit ``record``'s scales, then ``choose_codes`` on the refitted grid (GPTQ's ``grid``); a
    last refit follows. Returns the refitted record of lowest loss and its loss (``refit_scales``'s)."""
    best, best_loss = refit_scales(record, W, H, rule)
    candidate = best
    for _ in range(rounds):
        candidate, loss = refit_scales(choose_codes(candidate), W, H, rule)
        if loss < best_loss:
            best, best_loss = candidate, loss
    return best, best_loss
