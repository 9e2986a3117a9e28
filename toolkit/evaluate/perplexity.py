"""Perplexity on fixed held-out windows, so every model is scored on exactly the same tokens."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Perplexity:
    """exp(mean NLL) over ``tokens`` predicted tokens (each window's first token has no prediction)."""

    perplexity: float
    nll: float
    tokens: int


def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 4,
    on_batch: Callable[[int], None] | None = None,
) -> Perplexity:
    """Score ``windows`` [W, T] (token ids) with ``model``: each window is an independent sequence."""
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
            targets = batch[:, 1:]
            nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            if not torch.isfinite(nll):
                raise FloatingPointError("the model produced NaN or infinite logits on the evaluation windows")
            total_nll += float(nll)
            total_tokens += targets.numel()
            if on_batch:
                on_batch(batch.shape[0])
    mean = total_nll / total_tokens
    return Perplexity(math.exp(mean), mean, total_tokens)


def compare_perplexity(model_spec: str, base_spec: str, dataset: str, windows: int, seq_len: int,
                       on_batch: Callable[[str, int], None] | None = None) -> tuple[Perplexity, Perplexity]:
    """(model's, base's) perplexity on the same ``windows`` × ``seq_len`` held-out tokens of ``dataset``, each model
    loaded in float32 in turn (never both at once); ``on_batch(spec, windows_done)`` reports progress."""
    from toolkit.calibration import eval_windows
    from toolkit.runtime.load import load_model_or_checkpoint

    scores = []
    for spec in (model_spec, base_spec):
        model, tokenizer = load_model_or_checkpoint(spec, torch.float32)
        tokens = eval_windows(tokenizer, dataset, windows, seq_len)
        scores.append(perplexity(model, tokens, on_batch=(lambda n, s=spec: on_batch(s, n)) if on_batch else None))
        del model
    return scores[0], scores[1]
