import math

import torch

from conftest import tiny_model
from toolkit.evaluate.divergence import divergence
from toolkit.evaluate.perplexity import perplexity


def test_model_against_itself_has_zero_kl_and_full_agreement():
    model = tiny_model("llama", vocab=128)
    windows = torch.randint(0, 128, (3, 16))
    result = divergence(model, model, windows)
    assert abs(result.kl) < 1e-6 and result.top1_agreement == 1.0
    assert result.tokens == 3 * 15
    assert math.isclose(result.perplexity, perplexity(model, windows).perplexity, rel_tol=1e-5)


def test_perturbed_model_has_positive_kl_matching_a_direct_computation():
    base = tiny_model("llama", vocab=128)
    model = tiny_model("llama", vocab=128)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    windows = torch.randint(0, 128, (2, 12))
    result = divergence(model, base, windows, batch_size=1)
    with torch.no_grad():
        p = torch.log_softmax(base(windows).logits[:, :-1], -1)
        q = torch.log_softmax(model(windows).logits[:, :-1], -1)
    expected = torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum") / p[..., 0].numel()
    assert result.kl > 0 and math.isclose(result.kl, float(expected), rel_tol=1e-4)
    assert 0 <= result.top1_agreement < 1
