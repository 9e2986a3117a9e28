"""An EAGLE head drafting in compound's decode loop: a chain (vLLM's proposal) or an EAGLE-2 dynamic tree (SGLang's).

The drafter keeps its own KV cache of the *pairs* (target features of token i, token i + 1) at positions i, the same
pairs vLLM's EAGLE proposer feeds its draft model. At each call it first runs the pairs of the tokens accepted since
the last call (reading the target's real features, ``DraftContext.hidden``); the last pair's output drafts the
root's children. Then each tree level runs one draft step for the level's frontier: node n reads its parent's output
and its own token at position (last pair's position + depth of n) and attends to the cached pairs, its ancestors'
keys and its own (the pattern the training-time test of ``toolkit.heads.eagle`` trains). ``toolkit.decode.tree.eagle2_tree``
picks the frontier and the final nodes.

    decoder = eagle_decoder(target, max_len, head)            # returns the features the head reads
    out, stats = speculative_generate(decoder, EagleDrafter(head, depth=5, top_k=4, total_tokens=8), prompt, 128)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.decode import Decoder
from toolkit.decode.speculative import DraftContext, Proposal
from toolkit.decode.tree import eagle2_tree
from toolkit.heads.eagle import EagleHead


@dataclass(frozen=True)
class TreeShape:
    """A draft shape: ``depth`` draft steps, ``top_k`` children per expanded node, ``total_tokens`` nodes verified.
    top_k 1 with total_tokens = depth is vLLM's chain of ``depth`` speculative tokens; SGLang's flags are
    ``--speculative-num-steps depth --speculative-eagle-topk top_k --speculative-num-draft-tokens total_tokens + 1``
    (SGLang counts the root)."""

    depth: int
    top_k: int = 1
    total_tokens: int | None = None

    @property
    def nodes(self) -> int:
        """Nodes verified per step: ``total_tokens`` (default ``depth``), at most what the tree drafts (``top_k``
        children of the root, then ``top_k`` children of each of the ``top_k`` expanded nodes per step)."""
        return min(self.total_tokens or self.depth, self.top_k + (self.depth - 1) * self.top_k ** 2)

    def describe(self) -> str:
        if self.top_k == 1 and self.nodes == self.depth:
            return f"chain of {self.depth}"
        return f"tree: depth {self.depth}, top-{self.top_k}, {self.nodes} nodes"


def eagle_decoder(target: nn.Module, max_len: int, head: EagleHead) -> Decoder:
    """A decoder over ``target`` whose hidden output is what ``head`` reads (eagle3: its aux layers)."""
    return Decoder.from_model(target, max_len, feature_layers=head.config.aux_layers or None)


class EagleDrafter:
    """Proposes with an attached ``EagleHead`` (see the module docstring); ``max_len`` bounds the pairs cached."""

    def __init__(self, head: EagleHead, depth: int, top_k: int = 1, total_tokens: int | None = None,
                 max_len: int = 4096):
        self.head, self.shape = head.eval(), TreeShape(depth, top_k, total_tokens)
        if depth < 1 or top_k < 1 or self.shape.nodes < 1:
            raise ValueError(f"depth, top_k and total_tokens must be >= 1, got {depth}, {top_k}, {total_tokens}")
        c = head.config
        dtype = head.fc.weight.dtype
        self.k_cache = torch.zeros(1, c.num_key_value_heads, max_len, c.head_dim, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self._pairs: list[int] = []  # tokens[: pairs + 1] that the cached pairs were computed from
        if c.variant.own_lm_head:
            self._vocab = head.draft_to_target(torch.arange(c.draft_vocab_size))

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        tokens = ctx.tokens.tolist()
        T = ctx.hidden.shape[0]  # pairs 0..T-1; pair T-1 = (features of the last cached token, the root)
        if T + self.shape.depth > self.k_cache.shape[2]:
            raise ValueError(f"the drafter's cache holds {self.k_cache.shape[2]} pairs; build it with a larger max_len")
        keep = 0 if ctx.step == 0 else self._common_pairs(tokens)
        head = self.head
        hidden = head.fuse(ctx.hidden[keep:T])[None]
        new_tokens = torch.tensor(tokens[keep + 1:T + 1])[None]
        out = head.step(hidden, new_tokens, torch.arange(keep, T), self._prefix_attention(keep, T))
        self._pairs = tokens[:T + 1]
        tree = _Tree(self, out[0, -1], T)
        drafted, parents, calls = eagle2_tree(tree.expand, self.shape.depth, self.shape.top_k, self.shape.nodes)
        return Proposal(drafted, parents, None, draft_forwards=calls)

    def _common_pairs(self, tokens: list[int]) -> int:
        """Cached pairs still valid: those whose two tokens are unchanged."""
        n = 0
        limit = min(len(self._pairs), len(tokens))
        while n < limit and self._pairs[n] == tokens[n]:
            n += 1
        return max(0, n - 1)

    def _prefix_attention(self, start: int, end: int):
        """Attention of pairs [start, end): writes their keys and values to the cache, attends causally."""

        def attend(q, k, v):
            self.k_cache[:, :, start:end] = k
            self.v_cache[:, :, start:end] = v
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]  # (n, end)
            return F.scaled_dot_product_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end],
                                                  attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

        return attend

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the target vocabulary [f, V] of head logits [f, V_d]."""
        logp = logits.float().log_softmax(-1)
        if not self.head.config.variant.own_lm_head:
            return logp
        full = logp.new_full((logp.shape[0], self.head.config.vocab_size), float("-inf"))
        full[:, self._vocab] = logp
        return full


class _Tree:
    """The draft tree of one ``propose`` call: each expanded node's output and attention keys/values."""

    def __init__(self, drafter: EagleDrafter, root_out: torch.Tensor, pairs: int):
        self.drafter, self.head, self.pairs = drafter, drafter.head, pairs
        self.outputs: dict[int, torch.Tensor] = {-1: root_out}
        self.depth: dict[int, int] = {-1: 0}
        self.slot: dict[int, int] = {}  # expanded node -> row in keys/values
        c = self.head.config
        self.keys = root_out.new_empty(1, c.num_key_value_heads, 0, c.head_dim)
        self.values = self.keys

    def expand(self, tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor) -> torch.Tensor:
        nodes = frontier.tolist()
        if nodes == [-1]:
            return self.drafter.log_probs(self.head.logits(self.outputs[-1])[None])
        parent_of = parents.tolist()
        for n in nodes:
            self.depth[n] = self.depth[parent_of[n]] + 1
        hidden = torch.stack([self.outputs[parent_of[n]] for n in nodes])[None]  # (1, f, H)
        positions = torch.tensor([self.pairs - 1 + self.depth[n] for n in nodes])
        out = self.head.step(hidden, tokens[nodes][None], positions, self._attention(nodes, parent_of))
        for i, n in enumerate(nodes):
            self.outputs[n] = out[0, i]
        return self.drafter.log_probs(self.head.logits(out[0]))

    def _attention(self, nodes: list[int], parent_of: list[int]):
        """Frontier ``nodes`` attend to every cached pair, their expanded ancestors and themselves."""

        def attend(q, k, v):
            m, f = self.keys.shape[2], len(nodes)
            ancestors = torch.zeros(f, m, dtype=torch.bool)
            for i, n in enumerate(nodes):
                p = parent_of[n]
                while p >= 0:
                    ancestors[i, self.slot[p]] = True
                    p = parent_of[p]
            mask = torch.cat([torch.ones(f, self.pairs, dtype=torch.bool), ancestors,
                              torch.eye(f, dtype=torch.bool)], dim=1)
            drafter = self.drafter
            keys = torch.cat([drafter.k_cache[:, :, :self.pairs], self.keys, k], dim=2)
            values = torch.cat([drafter.v_cache[:, :, :self.pairs], self.values, v], dim=2)
            for i, n in enumerate(nodes):
                self.slot[n] = m + i
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=q.shape[1] != k.shape[1])

        return attend
