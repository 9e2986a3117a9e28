"""Medusa heads: a new head is the identity before its own copy of lm_head; the loss matches a per-position loop."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from toolkit.heads.medusa import MedusaConfig, MedusaHeads, medusa_loss


def _random_heads(K=3, L=2, H=16, V=50):
    heads = MedusaHeads(MedusaConfig(H, V, K, L))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads


def test_new_heads_start_as_the_targets_lm_head(one_thread):
    target = tiny_model("llama")
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    assert heads.config == MedusaConfig(64, 49152, 3, 2)
    hidden = torch.randn(5, 64)
    logits = heads(hidden)
    assert logits.shape == (5, 3, 49152)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], target.lm_head(hidden))
    blocks = [b.linear for head in heads.blocks for b in head]
    assert len({id(b) for b in blocks}) == 6, "every block is its own module"


def test_loss_matches_a_per_position_loop(one_thread):
    heads = _random_heads()
    B, T, decay = 2, 9, 0.8
    hidden = torch.randn(B, T, 16)
    ids = torch.randint(0, 50, (B, T))
    mask = torch.rand(B, T) > 0.3
    total, count, metrics = medusa_loss(heads, hidden, ids, mask, decay)

    expected, count0 = torch.zeros(()), 0
    for k in range(3):
        correct = n = 0
        for b in range(B):
            for t in range(T - 2 - k):
                if mask[b, t + 2 + k]:  # position t predicts the token 2 + k ahead, when that label is trained
                    logits = heads(hidden[b, t])[k]
                    expected += decay**k * F.cross_entropy(logits[None], ids[b, t + 2 + k][None])
                    correct += int(logits.argmax() == ids[b, t + 2 + k])
                    n += 1
        count0 = count0 or n
        assert metrics[f"count_{k}"] == n and metrics[f"correct_{k}"] == correct
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    assert count == count0


def test_loss_gradient_reaches_only_the_heads(one_thread):
    heads = _random_heads()
    hidden = torch.randn(1, 8, 16, requires_grad=True)
    total, _, _ = medusa_loss(heads, hidden, torch.randint(0, 50, (1, 8)), torch.ones(1, 8, dtype=torch.bool))
    total.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())


def test_short_sequences_and_bad_config():
    heads = _random_heads()
    total, count, metrics = medusa_loss(heads, torch.randn(1, 2, 16), torch.zeros(1, 2, dtype=torch.long),
                                        torch.ones(1, 2, dtype=torch.bool))
    assert count == 0 and float(total) == 0.0 and metrics == {}
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(16, 50, num_heads=0)


def test_shared_lm_head_is_one_frozen_product(one_thread):
    target = tiny_model("llama")
    heads = MedusaHeads.from_target(target, num_heads=3, shared_lm_head=True)
    assert len(heads.lm_heads) == 1 and not heads.lm_heads[0].weight.requires_grad
    with torch.no_grad():
        for head in heads.blocks:
            head[0].linear.weight.normal_(0, 0.1)
    hidden = torch.randn(5, 64)
    logits = heads(hidden)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], target.lm_head(heads.head_hidden(hidden, k)))
    total, _, _ = medusa_loss(heads, torch.randn(1, 8, 64), torch.randint(0, 49152, (1, 8)),
                              torch.ones(1, 8, dtype=torch.bool))
    total.backward()
    assert heads.lm_heads[0].weight.grad is None and heads.blocks[0][0].linear.weight.grad is not None
