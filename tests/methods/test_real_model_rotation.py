"""``--rotate hadamard`` on the real models: the rotated float model computes the original's logits (the claim that
rotation + GPTQ quantizes closer to the float model than GPTQ alone is tested beside the other methods' claims, in
``test_real_model_ordering.py``).

Parity runs in float64, RMSNorm included (transformers computes it in float32 whatever the model's dtype; the test
swaps in the same formula in the input's dtype), so the bound of 1e-4 on every logit tests the algebra alone
(measured: SmolLM2 max |Δ logit| 3.8e-13 on logits up to 34; Gemma-3 270M 2.9e-12 on logits up to 141). In float32
the same comparison measures float32 rounding, not the rotation (SmolLM2 7.3e-5; Gemma-3 3.5e-4 on logits up to 74,
262k-word vocabulary); with transformers' float32 norms in a float64 model, SmolLM2 8.3e-5.
"""

import pytest
import torch

from toolkit.models import EMBEDDED, arch_spec, load_model
from toolkit.rotate import rotate_model

pytestmark = pytest.mark.slow

MODELS = ("smollm2-135m", "gemma3-270m")
PARITY = 1e-4  # max |Δ logit|, float64


def available(spec: str) -> str:
    if spec not in EMBEDDED:
        pytest.skip(f"no embedded alias {spec!r} in toolkit.models.EMBEDDED (issue #38 item 2 adds Gemma-3 270M)")
    return spec


def norms_in_input_dtype(model) -> None:
    """Every RMSNorm of ``model`` computed in its input's dtype: ``x / rms(x) · (offset + w)``."""
    offset = arch_spec(model).norm_offset
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            module.forward = lambda x, m=module, eps=eps: \
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + m.weight)


@pytest.mark.parametrize("spec", MODELS)
def test_rotated_real_model_computes_the_same_logits(spec):
    model = load_model(available(spec), torch.float64)
    norms_in_input_dtype(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(tokens).logits
    embedding = model.get_input_embeddings().weight.clone()
    report = rotate_model(model, seed=0)
    with torch.inference_mode():
        gap = (model(tokens).logits - expected).abs().max().item()
    print(f"\n{spec}: {report}, max |Δ logit| {gap:.2e} on logits up to {expected.abs().max().item():.1f}")
    assert gap <= PARITY
    # the residual stream is rotated where the family allows it (not Gemma 3: norms on the branch outputs)
    assert (report.residual is not None) == (not torch.equal(embedding, model.get_input_embeddings().weight))
