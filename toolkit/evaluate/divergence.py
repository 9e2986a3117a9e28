"""How far a model's next-token distributions move from a base model's, on the same held-out windows.

KL(base ‖ model) per predicted token, averaged; top-1 agreement (same argmax); the perplexity of both. The two models
run batch by batch side by side, so no logits are stored beyond one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Divergence:
    """Mean KL(base ‖ model) in nats, top-1 agreement in [0, 1], both perplexities, over ``tokens`` predictions."""

    kl: float
    top1_agreement: float
    perplexity: float
    base_perplexity: float
    tokens: int


def divergence(
    model: nn.Module,
    base: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 2,
    on_batch: Callable[[int], None] | None = None,
) -> Divergence:
    """Compare ``model`` with ``base`` on ``windows`` [W, T] of token ids (each window scored from its 2nd token)."""
    kl_sum = agree = nll = base_nll = 0.0
    count = 0
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            targets = batch[:, 1:].reshape(-1)  # (B·(T-1),)
            logp = _log_probs(model, batch)  # (B·(T-1), V)
            base_logp = _log_probs(base, batch)
            kl_sum += float((base_logp.exp() * (base_logp - logp)).sum())
            agree += float((logp.argmax(-1) == base_logp.argmax(-1)).sum())
            nll -= float(logp.gather(1, targets[:, None]).sum())
            base_nll -= float(base_logp.gather(1, targets[:, None]).sum())
            count += targets.numel()
            if on_batch:
                on_batch(batch.shape[0])
    return Divergence(kl_sum / count, agree / count, math.exp(nll / count), math.exp(base_nll / count), count)


def _log_probs(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
    return torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
