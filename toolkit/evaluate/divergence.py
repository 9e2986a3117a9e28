"""How far a model's next-token distributions move from a base model's, on the same held-out windows.

Per predicted token: KL(base ‖ model) in nats, top-1 agreement (the same argmax), top-5 agreement (the base's argmax
is among the model's five most likely tokens), and both models' NLL of the true next token. Averages hide where a
model breaks, so the share of tokens whose KL is above ``kl_threshold`` and a histogram of KL over ``KL_EDGES`` are
kept too. The two models run batch by batch side by side, so no logits are stored beyond one batch; ``combine``
merges results of disjoint windows (slices) into their token-weighted total. Each window's mean NLL is kept as well,
so two models scored on the same windows can be compared pairwise, window by window (``paired_nll_difference``):
the spread of those differences says whether a gap in perplexity is more than the choice of windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

KL_THRESHOLD = 1.0  # nats: a token whose next-token distribution moved this far has broken, not drifted
KL_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0, math.inf)  # histogram bins [e_i, e_i+1)


@dataclass(frozen=True)
class Divergence:
    """Token means over ``tokens`` predictions: KL(base ‖ model) in nats, the share above ``kl_threshold``, top-1
    and top-5 agreement in [0, 1], both perplexities; ``kl_counts``: tokens per ``KL_EDGES`` bin; ``window_nll`` /
    ``base_window_nll``: the model's / the base's mean NLL of the true next token in each window, in window order."""

    kl: float
    kl_above: float
    kl_threshold: float
    top1_agreement: float
    top5_agreement: float
    perplexity: float
    base_perplexity: float
    tokens: int
    kl_counts: tuple[int, ...]
    window_nll: tuple[float, ...]
    base_window_nll: tuple[float, ...]


def divergence(
    model: nn.Module,
    base: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 2,
    on_batch: Callable[[int], None] | None = None,
    kl_threshold: float = KL_THRESHOLD,
) -> Divergence:
    """Compare ``model`` with ``base`` on ``windows`` [W, T] of token ids (each window scored from its 2nd token)."""
    if windows.shape[0] == 0 or windows.shape[1] < 2:
        raise ValueError(f"no tokens to compare: windows has shape {list(windows.shape)}")
    kl_sum = above = top1 = top5 = nll = base_nll = 0.0
    counts = torch.zeros(len(KL_EDGES) - 1, dtype=torch.long)
    window_nll: list[float] = []
    base_window_nll: list[float] = []
    edges = torch.tensor(KL_EDGES[1:-1])
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            targets = batch[:, 1:].reshape(-1, 1)  # (B·(T-1), 1)
            logp = _log_probs(model, batch)  # (B·(T-1), V)
            base_logp = _log_probs(base, batch)
            kl = (base_logp.exp() * (base_logp - logp)).sum(-1).clamp_min(0.0)  # rounding can dip below 0
            base_top = base_logp.argmax(-1, keepdim=True)
            kl_sum += float(kl.sum())
            above += float((kl > kl_threshold).sum())
            counts += torch.bincount(torch.bucketize(kl, edges, right=True), minlength=counts.numel())
            top1 += float((logp.argmax(-1, keepdim=True) == base_top).sum())
            top5 += float((logp.topk(5, -1).indices == base_top).any(-1).sum())
            token_nll = -logp.gather(1, targets).reshape(batch.shape[0], -1)  # (B, T-1)
            nll += float(token_nll.sum())
            window_nll += token_nll.mean(1).tolist()
            base_token_nll = -base_logp.gather(1, targets).reshape(batch.shape[0], -1)  # (B, T-1)
            base_nll += float(base_token_nll.sum())
            base_window_nll += base_token_nll.mean(1).tolist()
            if on_batch:
                on_batch(batch.shape[0])
    n = windows.shape[0] * (windows.shape[1] - 1)
    if not math.isfinite(kl_sum + nll + base_nll):
        raise FloatingPointError("a model produced NaN or infinite logits on the evaluation windows")
    return Divergence(kl_sum / n, above / n, kl_threshold, top1 / n, top5 / n, math.exp(nll / n),
                      math.exp(base_nll / n), n, tuple(int(c) for c in counts), tuple(window_nll),
                      tuple(base_window_nll))


def combine(parts: Sequence[Divergence]) -> Divergence:
    """The token-weighted total of results on disjoint windows (perplexities through their mean NLL)."""
    n = sum(p.tokens for p in parts)
    if not parts or not n:
        raise ValueError("nothing to combine: no part has tokens")

    def mean(value: Callable[[Divergence], float]) -> float:
        return sum(value(p) * p.tokens for p in parts) / n

    return Divergence(mean(lambda p: p.kl), mean(lambda p: p.kl_above), parts[0].kl_threshold,
                      mean(lambda p: p.top1_agreement), mean(lambda p: p.top5_agreement),
                      math.exp(mean(lambda p: math.log(p.perplexity))),
                      math.exp(mean(lambda p: math.log(p.base_perplexity))), n,
                      tuple(map(sum, zip(*(p.kl_counts for p in parts)))),
                      tuple(nll for p in parts for nll in p.window_nll),
                      tuple(nll for p in parts for nll in p.base_window_nll))


def paired_nll_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error) over windows of ``a - b``, two models' ``window_nll`` on the same windows: the
    difference of their log-perplexities, and how much of it the choice of windows could explain."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two results on the same windows (at least 2); got {len(a)} and {len(b)} windows")
    diffs = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return float(diffs.mean()), float(diffs.std() / math.sqrt(len(diffs)))


def _log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
    return torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
