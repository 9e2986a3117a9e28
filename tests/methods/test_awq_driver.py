"""AWQ layer driver (toolkit/methods/awq.py) on tiny random Llama (MHA and GQA) and Gemma models."""

import copy

import pytest
import torch
import transformers

from toolkit.engine.loop import quantize_layers
from toolkit.engine.session import LayerInputs
from toolkit.methods import awq as driver
from toolkit.methods import driver_for, rtn
from toolkit.models import arch_spec, decoder_layers
from toolkit.quant.configs import AWQConfig, RTNConfig

BITS, GROUP = 4, 32


def _tiny(model_type="llama", kv_heads=4, salient=True):
    """A seeded tiny model; with ``salient``, a few norm channels are scaled up so activations have the outlier
    channels of real LLMs (what AWQ is for), and norm weights are random (so Gemma's offset matters)."""
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, vocab_size=128)
    if model_type == "gemma":
        config = transformers.GemmaConfig(head_dim=16, **common)
    else:
        config = transformers.LlamaConfig(**common)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    offset = arch_spec(model).norm_offset
    with torch.no_grad():
        for layer in decoder_layers(model):
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.rand(64) + 0.5 - offset)
                if salient:
                    norm.weight[torch.randperm(64)[:4]] += 15
    return model


def _tokens(samples=16, length=32):
    return torch.randint(0, 128, (samples, length), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _last_hidden(model, tokens):
    with torch.no_grad():
        return model(tokens, output_hidden_states=True).hidden_states[-1]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _quantize(model, config, layer_driver, tokens):
    """Quantized weights and per-linear errors, by full name."""
    sink = {}
    errors = quantize_layers(model, config, layer_driver, tokens, lambda name, q: sink.__setitem__(name, q))
    return sink, errors


def test_driver_is_registered():
    assert driver_for(AWQConfig()) is driver.quantize_layer


@pytest.mark.parametrize("model_type,kv_heads", [("llama", 4), ("llama", 2), ("gemma", 4)])
def test_folding_random_scales_keeps_the_float_logits(model_type, kv_heads):
    model = _tiny(model_type, kv_heads)
    arch = arch_spec(model)
    tokens = _tokens(4)
    expected = _logits(model, tokens)
    g = torch.Generator().manual_seed(2)
    folded = []
    for layer in decoder_layers(model):
        for prev, names in arch.awq_groups:
            width = layer.get_submodule(names[0]).in_features
            if layer.get_submodule(prev).weight.shape[0] != width:
                continue  # v → o under GQA
            driver.fold_group(layer, prev, names, torch.rand(width, generator=g) * 3.5 + 0.25, arch.norm_offset)
            folded.append(prev)
    assert ("self_attn.v_proj" in folded) == (kv_heads == 4)
    assert _rel(_logits(model, tokens), expected) < 1e-5


def test_gemma_folding_needs_the_norm_offset():
    """The check above would catch a driver that ignored Gemma's x·(1 + w): folding with offset 0 moves the logits."""
    model = _tiny("gemma")
    tokens = _tokens(4)
    expected = _logits(model, tokens)
    layer = decoder_layers(model)[0]
    driver.fold_group(layer, "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      torch.full((64,), 2.0), norm_offset=0.0)
    assert _rel(_logits(model, tokens), expected) > 1e-2


@pytest.mark.parametrize("model_type,kv_heads", [("llama", 4), ("llama", 2), ("gemma", 4)])
def test_awq_beats_rtn_on_layer_outputs(model_type, kv_heads):
    model, tokens = _tiny(model_type, kv_heads), _tokens()
    reference = _last_hidden(model, tokens)
    awq_model, rtn_model = copy.deepcopy(model), copy.deepcopy(model)
    weights, errors = _quantize(awq_model, AWQConfig(bits=BITS, group_size=GROUP), driver.quantize_layer, tokens)
    _quantize(rtn_model, RTNConfig(bits=BITS, group_size=GROUP, sym=False), rtn.quantize_layer, tokens)
    awq_error = _rel(_last_hidden(awq_model, tokens), reference)
    rtn_error = _rel(_last_hidden(rtn_model, tokens), reference)
    assert awq_error < 0.8 * rtn_error, (awq_error, rtn_error)
    # Every linear of every layer came back, asymmetric, and the model holds exactly its dequantized weights.
    assert len(weights) == 2 * 7
    for name, q in weights.items():
        assert not q.sym and q.zero.dtype == torch.int32 and int(q.codes.max()) <= 15
        torch.testing.assert_close(awq_model.get_submodule(name).weight, q.dequantize(), rtol=0, atol=0)
    # The driver's error per linear is a relative output error: small but not zero at 4 bits.
    assert errors.keys() == weights.keys()
    assert all(0 < e < 0.2 for e in errors.values()), errors


@pytest.mark.parametrize("kv_heads,scales_v_to_o", [(4, True), (2, False)])
def test_searched_scales_fold_exactly_and_v_to_o_is_skipped_under_gqa(monkeypatch, kv_heads, scales_v_to_o):
    folds = []
    original = driver.fold_group

    def spy(layer, prev, names, scales, offset):
        folds.append((layer, prev, names, scales.clone(), offset))
        original(layer, prev, names, scales, offset)

    monkeypatch.setattr(driver, "fold_group", spy)
    model, tokens = _tiny("llama", kv_heads), _tokens(4)
    _quantize(model, AWQConfig(bits=BITS, group_size=GROUP, clip=False), driver.quantize_layer, tokens)
    expected = ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
    if scales_v_to_o:
        expected.insert(1, "self_attn.v_proj")
    assert [prev for _, prev, *_ in folds] == expected * 2

    # The scales the search chose, folded into the float model, leave its logits where they were.
    quantized_layers = list(decoder_layers(model))
    fresh = _tiny("llama", kv_heads)
    reference = _logits(fresh, tokens)
    for layer, prev, names, scales, offset in folds:
        original(decoder_layers(fresh)[quantized_layers.index(layer)], prev, names, scales, offset)
    assert not all(torch.allclose(scales, torch.ones_like(scales)) for *_, scales, _ in folds)
    assert _rel(_logits(fresh, tokens), reference) < 1e-5


def test_skipped_linears_leave_their_group_unscaled(monkeypatch):
    folded = []
    monkeypatch.setattr(driver, "fold_group", lambda layer, prev, *rest: folded.append(prev))
    config = AWQConfig(bits=BITS, group_size=GROUP, clip=False, skip=("lm_head", "mlp.down_proj"))
    sink, _ = _quantize(_tiny(), config, driver.quantize_layer, _tokens(4))
    assert "mlp.up_proj" not in folded and "input_layernorm" in folded
    assert not any(name.endswith("down_proj") for name in sink)


def test_subsample_sequences_is_seeded_and_cuts_batch_kwargs():
    hidden = [torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(2, 8, 16)]
    kwargs = [{"attention_mask": torch.ones(h.shape[0], 1, 8, 8), "position_embeddings": (torch.ones(1, 8, 4),) * 2}
              for h in hidden]
    inputs = LayerInputs(hidden, kwargs)
    a = driver.subsample_sequences(inputs, max_tokens=40, seed=3)
    b = driver.subsample_sequences(inputs, max_tokens=40, seed=3)
    assert sum(h.shape[0] for h in a.hidden) == 5  # 40 tokens // 8 per sequence
    assert all(torch.equal(x, y) for x, y in zip(a.hidden, b.hidden))
    for h, kw in zip(a.hidden, a.kwargs):
        assert kw["attention_mask"].shape[0] == h.shape[0]
        assert kw["position_embeddings"][0].shape == (1, 8, 4)
    assert driver.subsample_sequences(inputs, max_tokens=10_000, seed=0) is inputs
    assert sum(h.shape[0] for h in driver.subsample_sequences(inputs, max_tokens=3, seed=0).hidden) == 1


def test_driver_respects_max_tokens(monkeypatch):
    seen = []
    original = driver.subsample_sequences
    monkeypatch.setattr(driver, "subsample_sequences", lambda *a: seen.append(out := original(*a)) or out)
    _quantize(_tiny(), AWQConfig(bits=BITS, group_size=GROUP, max_tokens=128), driver.quantize_layer, _tokens())
    assert [sum(h.numel() // h.shape[-1] for h in s.hidden) for s in seen] == [128, 128]
