"""EAGLE heads: the training-time test against step-by-step decoding, the losses, the draft vocabulary, and lossless
speculative decoding with the drafter in chains and EAGLE-2 trees."""

import pytest
import torch
from conftest import tiny_model

from toolkit.decode import Decoder, generate, speculative_generate
from toolkit.decode.speculative import DraftContext
from toolkit.decode.tree import eagle2_tree
from toolkit.heads.eagle import (
    EagleHead,
    TTTAttention,
    draft_vocabulary,
    eagle3_loss,
    eagle3_step_outputs,
    eagle_loss,
    token_loss,
)
from toolkit.heads.eagle_config import EagleConfig
from toolkit.heads.eagle_draft import EagleDrafter, TreeShape, _Tree, eagle_decoder
from toolkit.heads.hidden_states import target_hidden_states
from toolkit.heads.kinds.eagle import eagle_shapes

VOCAB = 512


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model("llama", layers=8, vocab=VOCAB)


def _head(target, kind, draft_vocab=None, seed=1):
    torch.manual_seed(seed)
    head = EagleHead.from_target(target, kind, draft_vocab=draft_vocab)
    with torch.no_grad():  # a random layer that is not near the identity, so mistakes in wiring show
        for p in head.midlayer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def _features(target, head, ids):
    layers = list(head.config.aux_layers) if head.config.kind == "eagle3" else [-1]
    hidden = target_hidden_states(target, ids[None], layers)[0]
    return hidden.flatten(-2) if head.config.kind == "eagle3" else hidden


@torch.no_grad()
def test_training_time_test_matches_step_by_step_decoding(target):
    """Output k at position t of the unrolled training equals drafting k steps from the prefix 0..t with the same
    tokens forced, through the decode-time drafter (prefix cache, tree attention, positions)."""
    head = _head(target, "eagle3", draft_vocab=torch.arange(0, VOCAB, 2))
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (12,))
    features = target_hidden_states(target, ids[None], list(head.config.aux_layers))  # (1, T, n, H)
    steps = 4
    unrolled = eagle3_step_outputs(head, features, ids[None], steps)
    for t in (0, 3, 6):
        drafter = EagleDrafter(head, depth=steps, max_len=64)
        flat = features[0].flatten(-2)
        out = head.step(head.fuse(flat[:t + 1])[None], ids[1:t + 2][None], torch.arange(t + 1),
                        drafter._prefix_attention(0, t + 1))
        tree = _Tree(drafter, out[0, -1], t + 1)
        torch.testing.assert_close(out[0, -1], unrolled[0][0, t], rtol=1e-5, atol=1e-5)
        chain_tokens = ids[t + 2:t + 1 + steps]  # the drafted path forced to the data: tokens t+2 .. t+steps
        parents = torch.arange(len(chain_tokens)) - 1
        for k in range(1, steps):
            tree.expand(chain_tokens, parents, torch.tensor([k - 1]))
            torch.testing.assert_close(tree.outputs[k - 1], unrolled[k][0, t], rtol=1e-5, atol=1e-5)


def test_ttt_attention_masks():
    """Step 0 is causal; step k's query at t sees step-0 keys at <= t and its own position in steps 1..k only."""
    torch.manual_seed(0)
    B, h, T, d = 1, 2, 5, 4
    attend = TTTAttention()
    qs = [torch.randn(B, h, T, d) for _ in range(3)]
    ks = [torch.randn(B, h, T, d) for _ in range(3)]
    vs = [torch.randn(B, h, T, d) for _ in range(3)]
    outs = [attend(q, k, v) for q, k, v in zip(qs, ks, vs)]
    for step in range(3):
        for t in range(T):
            keys = torch.cat([ks[0][:, :, :t + 1]] + [ks[j][:, :, t:t + 1] for j in range(1, step + 1)], dim=2)
            values = torch.cat([vs[0][:, :, :t + 1]] + [vs[j][:, :, t:t + 1] for j in range(1, step + 1)], dim=2)
            weights = (qs[step][:, :, t:t + 1] @ keys.transpose(-1, -2) * d**-0.5).softmax(-1)
            torch.testing.assert_close(outs[step][:, :, t:t + 1], weights @ values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", [dict(depth=3), dict(depth=4, top_k=3, total_tokens=8)])
def test_speculative_decoding_is_lossless(target, kind, shape):
    """Greedy output with the drafter equals plain greedy decoding, chain and dynamic tree, both kinds."""
    head = _head(target, kind, draft_vocab=torch.arange(0, VOCAB, 3) if kind == "eagle3" else None)
    torch.manual_seed(3)
    prompt = torch.randint(0, VOCAB, (9,))
    plain, _ = generate(Decoder.from_model(target, 64), prompt, 30)
    out, stats = speculative_generate(eagle_decoder(target, 64, head), EagleDrafter(head, max_len=64, **shape),
                                      prompt, 30)
    assert torch.equal(out, plain)
    assert stats.draft_forwards == shape["depth"] * len(stats.accepted)


def test_fitted_head_is_accepted(target):
    """A head fitted to the target's own continuation of a prompt drafts it: accepted length well above 1."""
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
    seq, _ = generate(Decoder.from_model(target, 64), prompt, 40)
    head = EagleHead.from_target(target, "eagle3", draft_vocab=seq.unique())
    hidden = target_hidden_states(target, seq[None], list(head.config.aux_layers) + [-1])
    mask = torch.zeros(1, len(seq), dtype=torch.bool)
    mask[0, len(prompt):] = True
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    torch.manual_seed(0)
    head.train()
    for _ in range(150):
        optimizer.zero_grad()
        loss, count, _ = eagle3_loss(head, hidden, seq[None], mask, target.lm_head.weight, steps=3)
        (loss / count).backward()
        optimizer.step()
    out, stats = speculative_generate(eagle_decoder(target, 64, head), EagleDrafter(head.eval(), depth=3, max_len=64),
                                      prompt, 40)
    assert torch.equal(out, seq)
    assert stats.mean_accepted_length > 2.5


def test_eagle3_loss_counts_and_vocabulary(target):
    """The step-0 count is the labels from position 2 in the draft vocabulary; labels outside it are not trained."""
    vocab = torch.arange(0, VOCAB, 2)
    head = _head(target, "eagle3", draft_vocab=vocab)
    ids = torch.arange(20)[None] * 7 % VOCAB
    mask = torch.ones(1, 20, dtype=torch.bool)
    hidden = target_hidden_states(target, ids, list(head.config.aux_layers) + [-1])
    _, count, metrics = eagle3_loss(head, hidden, ids, mask, target.lm_head.weight, steps=2)
    assert count == int((ids[0, 2:] % 2 == 0).sum()) == metrics["count_0"]
    assert metrics["count_1"] == int((ids[0, 3:] % 2 == 0).sum())


def test_token_losses_against_their_definitions():
    """kl = sum of KL(target || draft) (0 for identical logits, torch's kl_div otherwise); ce = cross-entropy on the
    target's argmax token."""
    generator = torch.Generator().manual_seed(3)
    draft, target_logits = torch.randn(6, 11, generator=generator), torch.randn(6, 11, generator=generator)
    expected_kl = torch.nn.functional.kl_div(draft.log_softmax(-1), target_logits.log_softmax(-1), log_target=True,
                                             reduction="sum")
    torch.testing.assert_close(token_loss(draft, target_logits, "kl"), expected_kl)
    assert float(token_loss(target_logits, target_logits, "kl")) == pytest.approx(0, abs=1e-6)
    expected_ce = torch.nn.functional.cross_entropy(draft, target_logits.argmax(-1), reduction="sum")
    torch.testing.assert_close(token_loss(draft, target_logits, "ce"), expected_ce)
    with pytest.raises(ValueError, match="--loss must be one of kl, ce"):
        token_loss(draft, target_logits, "mse")


def test_eagle3_loss_kind_changes_only_the_token_loss(target):
    """eagle3_loss with ce counts the same labels and agrees with kl on which drafts are correct."""
    head = _head(target, "eagle3")
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 16, dtype=torch.bool)
    hidden = target_hidden_states(target, ids, list(head.config.aux_layers) + [-1])
    kl, count_kl, metrics_kl = eagle3_loss(head, hidden, ids, mask, target.lm_head.weight, steps=2, loss="kl")
    ce, count_ce, metrics_ce = eagle3_loss(head, hidden, ids, mask, target.lm_head.weight, steps=2, loss="ce")
    assert count_kl == count_ce and metrics_kl["correct_0"] == metrics_ce["correct_0"]
    assert float(kl) != pytest.approx(float(ce))


def test_eagle_loss_feature_regression_is_zero_for_a_perfect_prediction(target):
    """EAGLE-1's feature loss compares pair t's output with the feature of t + 1, on labels from position 2."""
    head = _head(target, "eagle")
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    hidden = target_hidden_states(target, ids)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 5:] = True
    head.eval()  # no noise
    loss, count, metrics = eagle_loss(head, hidden, ids, mask)
    assert count == 5 and metrics["count_0"] == 5
    with torch.no_grad():
        out = head.step(hidden[:, :-1], ids[:, 1:], torch.arange(9), lambda q, k, v: __import__(
            "toolkit.heads.eagle", fromlist=["causal_attention"]).causal_attention(q, k, v))
    expected = torch.nn.functional.smooth_l1_loss(out[0, 3:8], hidden[0, 4:9], reduction="none").mean(-1).sum()
    torch.testing.assert_close(torch.tensor(metrics["loss_feature"]), expected, rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_and_maps():
    """Most frequent labels, sorted; d2t/t2d are inverse on the draft vocabulary."""
    labels = [torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])]
    ids, covered = draft_vocabulary(labels, 16, 3)
    assert ids.tolist() == [5, 7, 9] and covered == pytest.approx(9 / 10)
    ids, _ = draft_vocabulary(labels, 16, 6)
    assert ids.tolist() == [0, 1, 2, 5, 7, 9]  # 4 distinct labels, then the lowest ids
    config = EagleConfig("eagle3", 8, 16, 2, 1, 4, 16, 6, aux_layers=(1, 2), target_layers=4)
    head = EagleHead(config)
    head.set_draft_vocab(ids)
    mapped = head.draft_to_target(torch.arange(6))
    assert mapped.tolist() == ids.tolist() and head.t2d[mapped].all() and int(head.t2d.sum()) == 6
    with pytest.raises(ValueError, match="draft vocabulary needs 6"):
        head.set_draft_vocab(torch.tensor([1, 2]))


def test_config_errors():
    with pytest.raises(ValueError, match="increasing aux_layers"):
        EagleConfig("eagle3", 8, 16, 2, 1, 4, 16, 16, aux_layers=(3, 1))
    with pytest.raises(ValueError, match="no aux_layers"):
        EagleConfig("eagle", 8, 16, 2, 1, 4, 16, 16, aux_layers=(1,))
    with pytest.raises(ValueError, match="kind must be"):
        EagleConfig("hydra", 8, 16, 2, 1, 4, 16, 16)


@pytest.mark.parametrize("depth,top_k,total", [(5, 4, 8), (6, 1, 10), (2, 4, 100), (3, 2, None)])
def test_tree_shape_counts_the_nodes_the_tree_drafts(depth, top_k, total):
    vocab = 50
    g = torch.Generator().manual_seed(0)

    def expand(tokens, parents, frontier):
        return torch.randn(frontier.shape[0], vocab, generator=g).log_softmax(-1)

    shape = TreeShape(depth, top_k, total)
    drafted, _, _ = eagle2_tree(expand, depth, top_k, total or depth)
    assert shape.nodes == drafted.shape[0]
    assert (shape.describe() == f"chain of {depth}") == (top_k == 1)


def test_explored_shapes_hold_a_real_tree_for_a_chain_trained_head():
    shapes = dict(eagle_shapes(TreeShape(5), 5))
    assert shapes["tree-wide"] == TreeShape(6, 2, 10) and shapes["tree-wide"].nodes == 10
    assert [shapes[k].describe() for k in ("chain", "chain-4", "chain-6")] == ["chain of 5", "chain of 4", "chain of 6"]


def test_unsupported_target_is_refused():
    gemma = tiny_model("gemma")
    with pytest.raises(ValueError, match="model_type 'gemma'"):
        EagleHead.from_target(gemma, "eagle3")


def test_draft_context_reuses_cached_pairs(target):
    """A second call recomputes only the pairs after the last cached one: same proposal as a fresh drafter."""
    head = _head(target, "eagle3")
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(2))
    feats = _features(target, head, ids)
    incremental = EagleDrafter(head, depth=3, top_k=2, total_tokens=5, max_len=64)
    incremental.propose(DraftContext(ids[:8], feats[:7], 0, None, None))
    second = incremental.propose(DraftContext(ids[:12], feats[:11], 1, None, None))
    fresh = EagleDrafter(head, depth=3, top_k=2, total_tokens=5, max_len=64).propose(
        DraftContext(ids[:12], feats[:11], 0, None, None))
    assert torch.equal(second.tokens, fresh.tokens) and torch.equal(second.parents, fresh.parents)


@pytest.mark.slow
def test_lossless_on_smollm2(one_thread):
    """On the real SmolLM2 target (float32), greedy decoding with a fresh head of each kind drafting an EAGLE-2 tree
    and vLLM's chain gives exactly the plain greedy tokens."""
    from toolkit.models import load_model, load_tokenizer

    target, tokenizer = load_model("smollm2-135m", torch.float32), load_tokenizer("smollm2-135m")
    prompt = torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
    plain, _ = generate(Decoder.from_model(target, 128), prompt, 24)
    for kind in ("eagle", "eagle3"):
        torch.manual_seed(0)
        vocab = torch.arange(0, target.config.vocab_size, 4) if kind == "eagle3" else None
        head = EagleHead.from_target(target, kind, draft_vocab=vocab).eval()
        for shape in (dict(depth=5, top_k=4, total_tokens=8), dict(depth=3)):
            out, _ = speculative_generate(eagle_decoder(target, 128, head), EagleDrafter(head, max_len=128, **shape),
                                          prompt, 24)
            assert torch.equal(out, plain), (kind, shape)
