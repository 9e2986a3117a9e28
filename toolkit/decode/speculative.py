"""Speculative decoding: a drafter proposes a tree of tokens, the target scores the whole tree in one forward, and the
longest path the target agrees with is kept, plus one token of the target's own.

Verification (``verify``) walks the tree from the root. Greedy: a child is accepted when its token is the target's
argmax, so the output is token-for-token plain greedy decoding. Sampling: recursive rejection sampling (Leviathan et
al., arXiv 2211.17192, Algorithm 1; for several children SpecInfer, arXiv 2305.09781 §4.2): with p the target's
distribution at the current node, child x drafted from q is accepted with probability min(1, p(x) / q(x)); on rejection
p becomes the residual norm(max(p - q, 0)) and the next child is tried; when no child is accepted the token is drawn
from the residual. Each emitted token is then distributed exactly as p, provided each child was drafted independently
of its siblings' rejections: either sampled from its own q (``Proposal.draft_probs``) or chosen deterministically (no
``draft_probs``: q is a point mass, accept with probability p(x), residual = p with x removed), the case of Medusa and
EAGLE-2 top-k trees.

A ``Drafter`` only proposes: ``propose(DraftContext) -> Proposal``. It sees the tokens so far (the last one, the root,
is decided but not yet in the target's cache) and the target's hidden states (the final-norm output, what
``lm_head`` reads) of every token in the cache: Medusa heads read the last one, an EAGLE drafter the ones accepted
since its previous call. It never touches the target's cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from toolkit.decode import tree as trees
from toolkit.decode.generate import DecodeStats, as_prompt, check_capacity, prefill
from toolkit.decode.model import DecodeError, Decoder
from toolkit.decode.sampling import SamplingConfig, draw, probs


@dataclass
class Proposal:
    """Draft nodes for one verify step (see ``toolkit.decode.tree`` for the tree layout).

    tokens: int64 [n]. parents: int64 [n], -1 = the root. draft_probs: float [n, vocab], the distribution each token was
    sampled from (given its parent), or None for deterministic proposals. draft_forwards: forward passes it cost.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_forwards: int = 1

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None, draft_forwards: int = 1) -> Proposal:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return cls(tokens, torch.arange(tokens.shape[0]) - 1, draft_probs, draft_forwards)


@dataclass
class DraftContext:
    """What a drafter may read at one step.

    tokens: int64 [T], prompt and generated tokens; ``tokens[-1]`` is the root of the next tree. hidden: [T - 1, D]
    target hidden states, row i computed from tokens[: i + 1] (so ``hidden[-1]`` predicted the root). step: 0 on the
    first call of a run (reset any state then). sampling / generator: the run's; None when greedy.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    step: int
    sampling: SamplingConfig | None
    generator: torch.Generator | None


@runtime_checkable
class Drafter(Protocol):
    def propose(self, ctx: DraftContext) -> Proposal: ...


def _accepts(p_x: float, q_x: float, u: float) -> bool:
    """The speculative-sampling test u < p(x) / q(x), for u ~ U[0, 1)."""
    return u * q_x < p_x


def verify(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig | None,
           generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(accepted node indices from the root down, the target's next token) for one tree.

    logits: the target's [n + 1, vocab] at the root (row 0) and at each node (row i + 1).
    """
    kids = trees.children(parents)
    token_list = tokens.tolist()
    path, node = [], -1
    while True:
        row = logits[node + 1]
        if sampling is None:
            target = int(row.float().argmax())
            child = next((c for c in kids.get(node, []) if token_list[c] == target), None)
            if child is None:
                return path, target
        else:
            p = probs(row, sampling)
            child = None
            for c in kids.get(node, []):
                x = token_list[c]
                q = draft_probs[c].float() if draft_probs is not None else None
                u = float(torch.rand((), generator=generator))
                if _accepts(float(p[x]), 1.0 if q is None else float(q[x]), u):
                    child = c
                    break
                p = _residual(p, q, x)
            if child is None:
                return path, draw(p, generator)
        path.append(child)
        node = child


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(p - q, 0)); q None is the point mass at x."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp(min=0.0)
    total = r.sum()
    return r / total if total > 0 else p  # total is 0 only when p <= q everywhere, where rejection had probability 0


@torch.inference_mode()
def speculative_generate(decoder: Decoder, drafter: Drafter, prompt_ids, max_new_tokens: int,
                         sampling: SamplingConfig | None = None,
                         eos_token_id: int | None = None) -> tuple[torch.Tensor, DecodeStats]:
    """Decode up to ``max_new_tokens`` after ``prompt_ids`` with ``drafter``'s proposals verified by ``decoder``.

    Returns (prompt and new tokens [P + N], stats), the same output distribution as ``generate`` (the same tokens
    when greedy). The decoder's max_len must hold the prompt and the new tokens; proposals that would overflow it
    near the end are cut (give it room for one more tree to keep every proposal whole).
    """
    prompt = as_prompt(prompt_ids, max_new_tokens)
    P = prompt.shape[0]
    check_capacity(decoder, P + max_new_tokens)
    generator = sampling.generator() if sampling is not None else None
    stats = DecodeStats()
    start = time.perf_counter()

    root, hidden = prefill(decoder, prompt, sampling, generator)
    stats.target_forwards = 1
    hiddens = hidden.new_empty(decoder.max_len, hidden.shape[-1])  # (max_len, D): hidden state of each cached token
    hiddens[:P] = hidden
    tokens = prompt.tolist() + [root]
    cached = P  # tokens in the target's cache: all of ``tokens`` but the root

    while len(tokens) - P < max_new_tokens and tokens[-1] != eos_token_id:
        t0 = time.perf_counter()
        ctx = DraftContext(torch.tensor(tokens), hiddens[:cached], len(stats.accepted), sampling, generator)
        proposal = drafter.propose(ctx)
        t1 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.draft_forwards += proposal.draft_forwards
        proposal = _checked(proposal, decoder.max_len - cached - 1)

        depth = trees.depths(proposal.parents)
        tree_tokens = torch.cat([torch.tensor([tokens[-1]]), proposal.tokens])  # (n + 1,) root first
        tree_depth = torch.cat([torch.zeros(1, dtype=torch.long), depth])
        logits, hidden = decoder(tree_tokens, cached, tree_depth, trees.ancestor_mask(proposal.parents))
        path, next_token = verify(proposal.tokens, proposal.parents, logits, sampling, generator,
                                  proposal.draft_probs)
        slots = [0] + [i + 1 for i in path]  # the root and the accepted nodes, in tree-row offsets
        decoder.cache.keep(cached, slots)
        hiddens[cached:cached + len(slots)] = hidden[slots]
        cached += len(slots)
        tokens += proposal.tokens[path].tolist() + [next_token]
        stats.target_forwards += 1
        stats.record_step(int(depth.max()) if depth.numel() else 0, len(path))
        stats.verify_s += time.perf_counter() - t1

    new = tokens[P:P + max_new_tokens]
    if eos_token_id in new:
        new = new[:new.index(eos_token_id) + 1]
    stats.new_tokens = len(new)
    stats.total_s = time.perf_counter() - start
    return torch.tensor(tokens[:P] + new, dtype=torch.long), stats


def _checked(proposal: Proposal, room: int) -> Proposal:
    """The proposal, validated, and cut to its first ``room`` nodes (still a tree: nodes are in topological order)."""
    try:
        trees.validate(proposal.tokens, proposal.parents)
    except ValueError as err:
        raise DecodeError(f"the drafter's proposal is not a tree: {err}") from err
    n = proposal.tokens.shape[0]
    if proposal.draft_probs is not None and proposal.draft_probs.shape[0] != n:
        raise DecodeError(f"draft_probs must be [n={n}, vocab], got {list(proposal.draft_probs.shape)}")
    if n <= room:
        return proposal
    probs_kept = None if proposal.draft_probs is None else proposal.draft_probs[:room]
    return Proposal(proposal.tokens[:room], proposal.parents[:room], probs_kept, proposal.draft_forwards)
