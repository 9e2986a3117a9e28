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
