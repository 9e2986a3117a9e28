"""``--rotate hadamard`` (``toolkit.rotate``): on a tiny model of every family the rotated float model's logits equal
the original's, with its weights really rotated (the residual stream where the family's entry allows it, each
head's values everywhere); a tied LM head is untied only when the final norm is not one number; and ``quantize``
composes it with every method into a checkpoint transformers reads as a standard model of its family."""

import json

import pytest
import torch
from torch import nn

from conftest import byte_tokenizer, perturb_biases_and_norms, tiny_config
from test_family_matrix import CALIBRATION, dense_reference, float_model
from toolkit.architectures import FAMILIES
from toolkit.experts import unfuse_experts
from toolkit.formats.checkpoint import MANIFEST
from toolkit.quant.configs import ConfigError, make_config
from toolkit.quantize import QuantizeSettings, quantize
from toolkit.rotate import rotate_model
from toolkit.runtime.load import load_quantized
from toolkit.validate import serving_preview

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]

VOCAB = 128
TOLERANCE = 1e-4  # max |Δ logit|, float32 model rotated in float64 and cast back


def tiny(model_type: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=VOCAB, **overrides)).eval()
    return perturb_biases_and_norms(unfuse_experts(model))


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_rotated_float_model_computes_the_same_logits(model_type):
    model = tiny(model_type)
    entry, before, expected = FAMILIES[model_type], weights(model), logits(model)
    report = rotate_model(model, seed=0)
    assert (logits(model) - expected).abs().max().item() <= TOLERANCE
    after = dict(model.named_parameters())
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    layer = "model.layers.0."
    values = layer + ("self_attn.qkv_proj.weight" if len(entry.qkv) == 1 else "self_attn.v_proj.weight")
    assert {values, layer + "self_attn.o_proj.weight"} <= changed  # each head's values, every family
    assert report.heads == "16 = Sylvester 16"
    if entry.rotates_residual:
        assert report.residual == "64 = Sylvester 64"
        assert {"model.embed_tokens.weight", layer + f"{entry.qkv[0]}.weight"} <= changed
        # every linear of the layer, and the pre-norms folded away (the identity scale)
        assert {n + ".weight" for n, m in model.model.layers[0].named_modules() if isinstance(m, nn.Linear)} <= \
            {n.removeprefix(layer) for n in changed}
        for norm in ("input_layernorm", entry.mlp_norm):
            assert torch.all(entry.norm_offset + after[layer + norm + ".weight"] == 1)
    else:  # Gemma 2/3: the stream, its norms and the q/k/gate/up/down readers are left as they were
        assert report.residual is None
        assert changed == {f"model.layers.{i}.{name}.weight" for i in range(2)
                           for name in ("self_attn.v_proj", "self_attn.o_proj")}


@pytest.mark.parametrize("model_type,hidden,residual,heads", [
    ("llama", 80, "80 = Paley 20 ⊗ Sylvester 4", "20 = Paley 20 ⊗ Sylvester 1"),
    ("gemma", 72, "72 = Paley 72 ⊗ Sylvester 1", "18 = random orthogonal 9 ⊗ Sylvester 2"),
    ("qwen2_moe", 96, "96 = Paley 12 ⊗ Sylvester 8", "24 = Paley 12 ⊗ Sylvester 2"),
])
def test_widths_that_are_not_a_power_of_two(model_type, hidden, residual, heads):
    model = tiny(model_type, hidden=hidden)
    expected = logits(model)
    report = rotate_model(model, seed=5)
    assert (report.residual, report.heads) == (residual, heads)
    assert (logits(model) - expected).abs().max().item() <= TOLERANCE


def test_a_tied_head_is_untied_only_when_the_final_norm_is_not_one_number():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    uniform = AutoModelForCausalLM.from_config(tiny_config("gemma", vocab=VOCAB)).eval()  # final norm: all zeros
    uniform.model.norm.weight.data.fill_(0.5)  # a scale of 1.5 everywhere
    expected = logits(uniform)
    assert rotate_model(uniform, 0).untied_weights == 0
    assert uniform.lm_head.weight is uniform.model.embed_tokens.weight and uniform.config.tie_word_embeddings
    assert (logits(uniform) - expected).abs().max().item() <= TOLERANCE

    varied = tiny("gemma")  # final norm perturbed
    assert varied.config.tie_word_embeddings
    expected = logits(varied)
    report = rotate_model(varied, 0)
    assert report.untied_weights == VOCAB * 64 and not varied.config.tie_word_embeddings
    assert varied.lm_head.weight.data_ptr() != varied.model.embed_tokens.weight.data_ptr()
    assert (logits(varied) - expected).abs().max().item() <= TOLERANCE
    assert report.summary(2) == ("hadamard: residual 64 = Sylvester 64, attention values 16 = Sylvester 16 per "
                                 "head; LM head untied (+0.0 MiB)")


def test_a_linear_the_table_does_not_place_is_refused():
    model = tiny("llama")
    model.model.layers[1].mlp.extra = nn.Linear(64, 64)
    with pytest.raises(RuntimeError, match="decoder layer 1: mlp.extra neither read"):
        rotate_model(model, 0)


def test_bad_requests_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--rotate must be one of none, hadamard, got 'spin'"):
        make_config("rtn", rotate="spin")
    with pytest.raises(ConfigError, match="--rotate hadamard .* needs the whole model in memory: run without "
                                          "--stream"):
        quantize("unused", make_config("rtn", rotate="hadamard"), tmp_path / "q",
                 settings=QuantizeSettings(stream=True))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "awq+gptq"])
@pytest.mark.parametrize("model_type", ["gemma", "gemma3_text"])
def test_quantize_composes_rotation_with_every_method(tmp_path, model_type, method):
    """8-bit codes of the rotated weights: the checkpoint, read by transformers as a plain compressed-tensors model
    of the family (its own loader, no rotation anywhere), is within 8-bit rounding of the original float model."""
    source = tmp_path / "float"
    original = float_model(model_type)
    original.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    config = make_config(method, bits=8, group_size=32, rotate="hadamard")
    result = quantize(str(source), config, tmp_path / "q", CALIBRATION,
                      QuantizeSettings(format="compressed-tensors", dtype="float32"))
    manifest = json.loads((result.output / MANIFEST).read_text())
    assert manifest["quantization"]["rotate"] == "hadamard"
    assert result.choices["rotation"].startswith("hadamard: ")
    assert serving_preview(result.output, [(64, 64)]).scheme.endswith(
        "hadamard rotation folded into the weights (nothing to undo when serving)")
    saved = json.loads((result.output / "config.json").read_text())
    assert saved["tie_word_embeddings"] is (model_type == "gemma3_text")  # gemma's final norm is not one number

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    theirs = dense_reference(result.output, "compressed-tensors")
    ours, _ = load_quantized(result.output, dtype=torch.float32, backend="reference")
    with torch.no_grad():
        expected, got, read = original(ids).logits, ours(ids).logits, theirs(ids).logits
    assert (read - got).abs().max().item() <= 1e-3  # transformers and compound read the same model
    scale = expected.abs().mean().item()
    assert (got - expected).abs().mean().item() <= 0.02 * scale, (got - expected).abs().mean().item() / scale


def test_the_memory_and_disk_estimates_count_a_head_the_rotation_may_untie():
    from toolkit.engine import memory

    tied, untied = tiny("gemma"), tiny("llama")  # the tiny Gemma ties its head, the tiny Llama does not
    for model, extra in ((tied, VOCAB * 64), (untied, 0)):
        plain, rotated = make_config("rtn", group_size=32), make_config("rtn", group_size=32, rotate="hadamard")
        assert memory.disk_estimate(model, rotated, 0, 8, 2, offload=False) - \
            memory.disk_estimate(model, plain, 0, 8, 2, offload=False) == extra * 2
        parts = memory.estimate(model, rotated, 0, 8, streamed=False).parts
        assert parts["rotation"] == extra * memory.FLOAT + 3 * memory.ROTATED_ROWS * 64 * 8
        assert "rotation" not in memory.estimate(model, plain, 0, 8, streamed=False).parts
