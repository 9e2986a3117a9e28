"""Token trees for speculative decoding: structure, attention masks, and the two ways drafters build them.

A tree of ``n`` draft nodes is two [n] int64 tensors: ``tokens`` and ``parents`` (the index of each node's parent,
-1 for the root, always smaller than the node's own index, so index order is a topological order). The root is the
last token already decided (sampled but not yet in the target's cache); it is not part of a proposal. A chain of k
drafts is the tree ``parents = [-1, 0, 1, ..., k-2]``.

* ``static_tree`` / ``static_tree_proposal``: Medusa's fixed tree (arXiv 2401.10774 §2.1.2), given as paths of top-k
  ranks: path (0, 2) is the node reached by head 1's best token then head 2's third best.
* ``eagle2_tree``: EAGLE-2's dynamic tree (arXiv 2406.16858 §4): expand the ``top_k`` nodes of highest cumulative
  log-probability at each depth, then keep the ``total_tokens`` best nodes of all that were drafted.
"""

from __future__ import annotations

from typing import Callable

import torch


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node [n] (a child of the root has depth 1)."""
    depth = []
    for p in parents.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Bool [n + 1, n + 1] over the root (index 0) and the nodes (index i + 1): row j is True at j's ancestors and j."""
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[1:, 0] = True
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


def children(parents: torch.Tensor) -> dict[int, list[int]]:
    """Node index → its children in index order; key -1 is the root."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents.tolist()):
        kids.setdefault(p, []).append(i)
    return kids


def validate(tokens: torch.Tensor, parents: torch.Tensor) -> None:
    """Raise ValueError unless tokens and parents form a tree in topological order."""
    if tokens.ndim != 1 or tokens.shape != parents.shape:
        raise ValueError(f"tokens and parents must both be [n], got {list(tokens.shape)} and {list(parents.shape)}")
    bad = [i for i, p in enumerate(parents.tolist()) if not -1 <= p < i]
    if bad:
        raise ValueError(f"parents[i] must be -1 (the root) or an earlier node, not so at nodes {bad[:5]}")


def static_tree(paths: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents [n], depth [n], rank [n]) of a Medusa tree given as paths of top-k ranks, in (depth, path) order.

    Every prefix of a path must itself be a path: (0, 1) needs (0,).
    """
    order = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(order)}
    missing = [p for p in order if len(p) == 0 or (len(p) > 1 and p[:-1] not in index)]
    if missing:
        raise ValueError(f"every path needs its prefix in the tree (and none may be empty): missing parents of "
                         f"{missing[:3]}; add e.g. {missing[0][:-1]}")
    parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in order], dtype=torch.long)
    depth = torch.tensor([len(p) for p in order], dtype=torch.long)
    rank = torch.tensor([p[-1] for p in order], dtype=torch.long)
    return parents, depth, rank


def static_tree_proposal(paths: list[tuple[int, ...]], topk_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n], parents [n]) of a Medusa tree; ``topk_tokens`` [heads, k]: head d's k best tokens, best first."""
    parents, depth, rank = static_tree(paths)
    if depth.max() > topk_tokens.shape[0] or rank.max() >= topk_tokens.shape[1]:
        raise ValueError(f"the tree needs {int(depth.max())} heads and top-{int(rank.max()) + 1}; "
                         f"got topk_tokens of shape {list(topk_tokens.shape)}")
    return topk_tokens[depth - 1, rank], parents


# expand(tokens [m], parents [m], frontier [f]) -> log-probs [f, vocab] of the token after each frontier node
# (frontier index -1 is the root; tokens/parents are the whole tree drafted so far)
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eagle2_tree(expand: Expand, depth: int, top_k: int, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens [n], parents [n], expand calls) of an EAGLE-2 dynamic tree with n <= total_tokens.

    Each of ``depth`` rounds expands the frontier (first the root) into its top_k children, scored by cumulative
    log-probability (the draft's estimate of the path's acceptance); the next frontier is the top_k children of the
    round. Reranking keeps the total_tokens best of all drafted nodes. A child never scores above its parent (log-probs
    are clamped to <= 0 and ties keep index order), so the kept nodes always form a tree that contains their ancestors.
    """
    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError(f"depth, top_k and total_tokens must be >= 1, got {depth}, {top_k}, {total_tokens}")
    tokens = torch.empty(0, dtype=torch.long)
    parents = torch.empty(0, dtype=torch.long)
    scores = torch.empty(0)
    frontier, frontier_scores = torch.tensor([-1]), torch.zeros(1)
    for _ in range(depth):
        logp = expand(tokens, parents, frontier).float().clamp(max=0.0)  # (f, vocab)
        top_logp, top_tokens = logp.topk(top_k, dim=-1)  # (f, k)
        cumulative = (frontier_scores[:, None] + top_logp).flatten()  # (f * k,)
        first = tokens.shape[0]
        tokens = torch.cat([tokens, top_tokens.flatten()])
        parents = torch.cat([parents, frontier.repeat_interleave(top_k)])
        scores = torch.cat([scores, cumulative])
        best = cumulative.topk(min(top_k, cumulative.shape[0])).indices
        frontier, frontier_scores = first + best, cumulative[best]
    keep = torch.sort(-scores, stable=True).indices[:total_tokens].sort().values  # best nodes, back in index order
    new_index = torch.full((tokens.shape[0] + 1,), -1, dtype=torch.long)  # old index + 1 → new index (root stays -1)
    new_index[keep + 1] = torch.arange(keep.shape[0])
    return tokens[keep], new_index[parents[keep] + 1], depth
