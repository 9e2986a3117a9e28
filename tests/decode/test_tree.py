import pytest
import torch

from toolkit.decode.tree import ancestor_mask, children, depths, eagle2_tree, static_tree, static_tree_proposal, validate


def test_ancestor_mask_and_depths():
    parents = torch.tensor([-1, -1, 0, 2])
    assert depths(parents).tolist() == [1, 1, 2, 3]
    assert children(parents) == {-1: [0, 1], 0: [2], 2: [3]}
    expected = torch.tensor([
        [1, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0],  # node 0
        [1, 0, 1, 0, 0],  # node 1
        [1, 1, 0, 1, 0],  # node 2: root, node 0, itself
        [1, 1, 0, 1, 1],  # node 3
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(parents), expected)


def test_validate_refuses_non_topological_trees():
    with pytest.raises(ValueError, match="earlier node, not so at nodes \\[1\\]"):
        validate(torch.tensor([5, 6]), torch.tensor([-1, 1]))


def test_static_tree_from_paths():
    parents, depth, rank = static_tree([(0, 0), (1,), (0,), (0, 1), (0, 0, 0)])
    # order: (0,), (1,), (0, 0), (0, 1), (0, 0, 0)
    assert parents.tolist() == [-1, -1, 0, 0, 2]
    assert depth.tolist() == [1, 1, 2, 2, 3]
    assert rank.tolist() == [0, 1, 0, 1, 0]
    topk = torch.tensor([[10, 11], [20, 21], [30, 31]])  # head d's two best tokens
    tokens, _ = static_tree_proposal([(0, 0), (1,), (0,), (0, 1), (0, 0, 0)], topk)
    assert tokens.tolist() == [10, 11, 20, 21, 30]
    with pytest.raises(ValueError, match="missing parents of \\[\\(1, 0\\)\\]"):
        static_tree([(0,), (1, 0)])


def _path(tokens, parents, node):
    """The token path from the root's first child down to ``node`` (empty for the root, -1)."""
    out = []
    while node >= 0:
        out.append(int(tokens[node]))
        node = int(parents[node])
    return tuple(out[::-1])


def _draft_logprobs(path, vocab=6):
    """A fixed draft distribution after each token path."""
    g = torch.Generator().manual_seed(hash(path) % 2**31)
    return torch.log_softmax(torch.randn(vocab, generator=g) * 2, dim=-1)


def _score(path):
    return sum(float(_draft_logprobs(path[:i])[path[i]]) for i in range(len(path)))


def test_eagle2_tree_keeps_the_best_connected_nodes():
    frontier_sizes = []

    def expand(tokens, parents, frontier):
        frontier_sizes.append(len(frontier))
        return torch.stack([_draft_logprobs(_path(tokens, parents, int(f))) for f in frontier])

    tokens, parents, calls = eagle2_tree(expand, depth=3, top_k=2, total_tokens=100)
    assert calls == 3 and frontier_sizes == [1, 2, 2]  # the root, then the top_k best nodes of each depth
    drafted = {_path(tokens, parents, i) for i in range(len(tokens))}
    assert len(drafted) == 2 + 4 + 4
    for path in drafted:  # each node is one of its parent's top_k tokens
        assert path[-1] in _draft_logprobs(path[:-1]).topk(2).indices.tolist()

    tokens, parents, _ = eagle2_tree(expand, depth=3, top_k=2, total_tokens=5)
    validate(tokens, parents)  # index order is topological, so every kept node's ancestors are kept
    kept = {_path(tokens, parents, i) for i in range(len(tokens))}
    assert kept == set(sorted(drafted, key=_score, reverse=True)[:5])
