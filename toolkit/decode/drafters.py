"""Drafters that need nothing beyond ``toolkit.decode``: a separate draft model, and Medusa heads over a static tree.

An EAGLE drafter (its own decoder layer fed the target's hidden states) lives with its head in ``toolkit.heads`` and
builds its dynamic tree with ``toolkit.decode.tree.eagle2_tree``.
"""

from __future__ import annotations

from typing import Callable

import torch

from toolkit.decode.model import Decoder
from toolkit.decode.sampling import probs, sample
from toolkit.decode.speculative import DraftContext, Proposal
from toolkit.decode.tree import static_tree, static_tree_proposal


class ModelDrafter:
    """A smaller causal LM sharing the target's vocabulary drafts a chain of ``k`` tokens (Leviathan et al. 2023).

    It keeps its own KV cache (``decoder``) and, at each call, reuses the longest cached prefix of the context, so
    rejected drafts are simply overwritten. Costs k draft forwards per step.
    """

    def __init__(self, decoder: Decoder, k: int):
        if k < 1:
            raise ValueError(f"k (drafts per step) must be >= 1, got {k}")
        self.decoder, self.k = decoder, k
        self._cached: list[int] = []  # tokens in the draft cache, slot i = token i

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        tokens = ctx.tokens.tolist()
        if ctx.step == 0:
            self._cached = []
        keep = 0
        while keep < min(len(self._cached), len(tokens) - 1) and self._cached[keep] == tokens[keep]:
            keep += 1
        logits, _ = self.decoder(torch.tensor(tokens[keep:]), keep)
        self._cached = tokens
        drafts, draft_probs = [], []
        for i in range(self.k):
            if i > 0:
                logits, _ = self.decoder(torch.tensor(drafts[-1:]), len(self._cached))
                self._cached = self._cached + drafts[-1:]
            row = logits[-1]
            if ctx.sampling is not None:
                draft_probs.append(probs(row, ctx.sampling))
            drafts.append(sample(row, ctx.sampling, ctx.generator))
        return Proposal.chain(drafts, torch.stack(draft_probs) if draft_probs else None, draft_forwards=self.k)


class MedusaDrafter:
    """Medusa heads (arXiv 2401.10774) over a static tree: head d, read from the target's last hidden state, guesses
    the token d steps after the root; ``paths`` lists the tree as top-k ranks per depth, e.g. [(0,), (1,), (0, 0)].

    heads: callable hidden [D] -> logits [heads, vocab]. Proposals are deterministic (top-k), so verification is
    lossless in sampling mode too. One draft forward per step.
    """

    def __init__(self, heads: Callable[[torch.Tensor], torch.Tensor], paths: list[tuple[int, ...]]):
        self.heads, self.paths = heads, [tuple(p) for p in paths]
        parents, depth, rank = static_tree(self.paths)
        self.n_heads, self.top_k = int(depth.max()), int(rank.max()) + 1

    def head_logits(self, ctx: DraftContext) -> torch.Tensor:
        """Logits [heads, vocab] of the heads at this step."""
        return self.heads(ctx.hidden[-1])

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        topk_tokens = self.head_logits(ctx)[: self.n_heads].topk(self.top_k, dim=-1).indices  # (heads, k)
        tokens, parents = static_tree_proposal(self.paths, topk_tokens)
        return Proposal(tokens, parents, None, draft_forwards=1)
