"""Turning logits into a token: greedy, or sampling with temperature and nucleus (top-p) filtering.

The speculative verifier reuses ``probs`` so that the distribution it preserves is exactly the one plain sampling
draws from (temperature and top-p applied to the target's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one run; pass ``sampling=None`` to the decode functions for greedy decoding.

    temperature: divides the logits (1.0 = the model's distribution; lower is sharper; must be > 0).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = no filtering).
    seed: seeds the run's ``torch.Generator``, so a run is reproducible on the same hardware.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    version: int = 1

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; for greedy decoding pass sampling=None")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; 1.0 disables nucleus filtering")

    def generator(self, device="cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)


def probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The sampling distribution over the vocabulary, float32 [..., vocab]."""
    p = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the most likely token is always kept)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= sampling.top_p
        p = p.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def sample(logits: torch.Tensor, sampling: SamplingConfig | None, generator: torch.Generator | None) -> int:
    """One token from logits [vocab]: the argmax when ``sampling`` is None, else a draw from ``probs``."""
    if sampling is None:
        return int(logits.float().argmax())  # the same index; torch's bf16 argmax is ~5x slower than fp32's
    return draw(probs(logits, sampling), generator)


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution p [vocab]."""
    return int(torch.multinomial(p, 1, generator=generator))
