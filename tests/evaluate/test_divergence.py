import math

import pytest
import torch

from conftest import tiny_model
from toolkit.evaluate.divergence import KL_EDGES, combine, divergence, paired_nll_difference
from toolkit.evaluate.perplexity import perplexity


@pytest.fixture(scope="module")
def perturbed():
    model = tiny_model("llama", vocab=128)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_model_against_itself_has_zero_kl_and_full_agreement():
    model = tiny_model("llama", vocab=128)
    windows = torch.randint(0, 128, (3, 16))
    result = divergence(model, model, windows)
    assert abs(result.kl) < 1e-6 and result.kl_above == 0.0
    assert result.top1_agreement == 1.0 and result.top5_agreement == 1.0
    assert result.tokens == 3 * 15 and result.kl_counts[0] == result.tokens  # every token in the [0, 1e-4) bin
    assert math.isclose(result.perplexity, perplexity(model, windows).perplexity, rel_tol=1e-5)
    assert result.perplexity == result.base_perplexity


def test_perturbed_model_matches_a_direct_computation(perturbed):
    base = tiny_model("llama", vocab=128)
    windows = torch.randint(0, 128, (2, 12))
    result = divergence(perturbed, base, windows, batch_size=1, kl_threshold=0.02)
    with torch.no_grad():
        p = torch.log_softmax(base(windows).logits[:, :-1], -1).reshape(-1, 128)
        q = torch.log_softmax(perturbed(windows).logits[:, :-1], -1).reshape(-1, 128)
    kl = (p.exp() * (p - q)).sum(-1)
    assert result.kl > 0 and math.isclose(result.kl, float(kl.mean()), rel_tol=1e-4)
    assert math.isclose(result.kl_above, float((kl > 0.02).float().mean()), abs_tol=1e-9)
    base_top = p.argmax(-1)
    assert math.isclose(result.top1_agreement, float((q.argmax(-1) == base_top).float().mean()))
    in_top5 = [int(t) in set(row.tolist()) for t, row in zip(base_top, q.topk(5, -1).indices)]
    assert math.isclose(result.top5_agreement, sum(in_top5) / len(in_top5))
    assert result.top5_agreement >= result.top1_agreement
    expected_counts = [int(((kl >= lo) & (kl < hi)).sum()) for lo, hi in zip(KL_EDGES, KL_EDGES[1:])]
    assert list(result.kl_counts) == expected_counts and sum(result.kl_counts) == result.tokens == 22
    token_nll = -q.gather(1, windows[:, 1:].reshape(-1, 1)).reshape(2, 11)
    assert torch.allclose(torch.tensor(result.window_nll), token_nll.mean(1), rtol=1e-5)
    assert math.isclose(math.exp(sum(result.window_nll) / 2), result.perplexity, rel_tol=1e-5)


def test_combining_disjoint_windows_equals_scoring_them_together(perturbed):
    base = tiny_model("llama", vocab=128)
    windows = torch.randint(0, 128, (5, 10))
    whole = divergence(perturbed, base, windows)
    parts = combine([divergence(perturbed, base, windows[:2]), divergence(perturbed, base, windows[2:])])
    assert parts.tokens == whole.tokens and parts.kl_counts == whole.kl_counts
    assert torch.allclose(torch.tensor(parts.window_nll), torch.tensor(whole.window_nll), rtol=1e-5)
    for field in ("kl", "kl_above", "top1_agreement", "top5_agreement", "perplexity", "base_perplexity"):
        assert math.isclose(getattr(parts, field), getattr(whole, field), rel_tol=1e-5), field


def test_no_windows_is_refused():
    model = tiny_model("llama", vocab=128)
    with pytest.raises(ValueError, match="no tokens"):
        divergence(model, model, torch.zeros(0, 8, dtype=torch.long))


def test_paired_nll_difference_is_the_mean_window_gap_with_its_standard_error(perturbed):
    base = tiny_model("llama", vocab=128)
    windows = torch.randint(0, 128, (4, 10))
    a, b = divergence(perturbed, base, windows), divergence(base, base, windows)
    gaps = torch.tensor(a.window_nll, dtype=torch.float64) - torch.tensor(b.window_nll, dtype=torch.float64)
    mean, se = paired_nll_difference(a.window_nll, b.window_nll)
    assert math.isclose(mean, math.log(a.perplexity) - math.log(b.perplexity), rel_tol=1e-4)
    assert math.isclose(se, float(gaps.std()) / 2, rel_tol=1e-9) and se > 0
    assert paired_nll_difference(a.window_nll, a.window_nll) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same windows"):
        paired_nll_difference(a.window_nll, divergence(base, base, windows[:3]).window_nll)
