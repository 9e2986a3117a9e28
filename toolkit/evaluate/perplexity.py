"""Perplexity on fixed held-out windows, so every model is scored on exactly the same tokens, with its 95 % interval
over windows: exp(mean NLL ± 1.96 · its standard error), the windows' mean NLLs taken as the samples. A difference
between two models on the same windows is paired window by window (``ratio_interval``), which is much tighter than
either interval: the windows' difficulty cancels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.models import ModelSource, resolve_model

EVAL_WINDOWS = 32  # held-out windows of a default evaluation (per verb; compound eval spreads them over its slices)
Z95 = 1.96  # a normal 95 % interval



@dataclass(frozen=True)
class Perplexity:
    """exp(mean NLL) over ``tokens`` predicted tokens (each window's first token has no prediction); ``window_nll``:
    each window's mean NLL, in window order."""

    perplexity: float
    nll: float
    tokens: int
    window_nll: tuple[float, ...] = ()


def perplexity_interval(window_nll: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % interval of a perplexity over its windows (each window's mean NLL, windows of one length); None
    with fewer than two windows."""
    if len(window_nll) < 2:
        return None
    samples = torch.tensor(window_nll, dtype=torch.float64)
    mean, se = float(samples.mean()), _standard_error(samples)
    return math.exp(mean - Z95 * se), math.exp(mean + Z95 * se)


def ratio_interval(model_nll: Sequence[float], base_nll: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % interval of one model's perplexity over another's on the same windows (their ``window_nll``),
    paired window by window; None with fewer than two windows or windows that differ in number."""
    if len(model_nll) < 2 or len(model_nll) != len(base_nll):
        return None
    diffs = torch.tensor(model_nll, dtype=torch.float64) - torch.tensor(base_nll, dtype=torch.float64)
    mean, se = float(diffs.mean()), _standard_error(diffs)
    return math.exp(mean - Z95 * se), math.exp(mean + Z95 * se)


def _standard_error(samples: torch.Tensor) -> float:
    return float(samples.std() / math.sqrt(samples.numel()))


def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 4,
    on_batch: Callable[[int], None] | None = None,
) -> Perplexity:
    """Score ``windows`` [W, T] (token ids) with ``model``: each window is an independent sequence."""
    total_nll, total_tokens, window_nll = 0.0, 0, []
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
            targets = batch[:, 1:]
            token_nll = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T-1)
            nll = token_nll.sum()
            if not torch.isfinite(nll):
                raise FloatingPointError("the model produced NaN or infinite logits on the evaluation windows")
            total_nll += float(nll)
            window_nll += token_nll.mean(1).tolist()
            total_tokens += targets.numel()
            if on_batch:
                on_batch(batch.shape[0])
    mean = total_nll / total_tokens
    return Perplexity(math.exp(mean), mean, total_tokens, tuple(window_nll))


def compare_perplexity(model: str | ModelSource, base: str | ModelSource, dataset: str, windows: int, seq_len: int,
                       on_batch: Callable[[str, int], None] | None = None) -> tuple[Perplexity, Perplexity]:
    """(model's, base's) perplexity on the same ``windows`` × ``seq_len`` held-out tokens of ``dataset``, each model
    (a spec, resolved here, or its ``ModelSource``) loaded in float32 in turn (never both at once);
    ``on_batch(spec, windows_done)`` reports progress."""
    from toolkit.calibration import eval_windows
    from toolkit.runtime.load import load_model_or_checkpoint

    scores = []
    for source in map(resolve_model, (model, base)):
        loaded, tokenizer = load_model_or_checkpoint(source, torch.float32)
        tokens = eval_windows(tokenizer, dataset, windows, seq_len)
        scores.append(perplexity(loaded, tokens, on_batch=(lambda n, s=source.spec: on_batch(s, n)) if on_batch
                                 else None))
        del loaded
    return scores[0], scores[1]
