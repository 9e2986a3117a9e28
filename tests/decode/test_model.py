"""The decoder forward against transformers: full, cached, tree inputs, compaction, INT8 cache, the real model."""

import pytest
import torch
from torch import nn

from conftest import int4_linears, perturb_biases_and_norms, tiny_config, tiny_model
from toolkit.architectures import supporting
from toolkit.decode import Decoder, DecodeError
from toolkit.decode.tree import ancestor_mask, depths

FAMILIES = supporting("decode")
VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


def spread(model, logit_scale=40.0):
    """Make a random tiny model exercise everything: nonzero biases and norm weights, logits of order 1 to 10."""
    perturb_biases_and_norms(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model


def family_model(model_type, **config_overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return spread(AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=VOCAB, **config_overrides)).eval())


@pytest.fixture(params=["native", "torch"])
def forward(request):
    """Which forward a decoder runs: the C++ step (toolkit.runtime.decode_step, the default where it builds) or the
    torch one."""
    if request.param == "native" and Decoder.from_model(tiny_model("llama"), 4).native_step is None:
        pytest.skip("the C++ decode step does not run on this CPU")
    return request.param


def decoder_for(model, max_len, forward, **kwargs):
    """``Decoder.from_model`` running ``forward``."""
    decoder = Decoder.from_model(model, max_len, **kwargs)
    if forward == "torch":
        decoder.native_step = None
    return decoder


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None]).logits[0].float()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_forward_matches_transformers_full_and_cached(model_type, forward):
    model = family_model(model_type)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(model, ids)
    assert ref.abs().max() > 1.0  # the comparison below means something
    decoder = decoder_for(model, 32, forward)
    full, _ = decoder(ids, 0)
    assert (full.float() - ref).abs().max() < 1e-4

    rows = [decoder(ids[:7], 0)[0]]  # prefill, then one token at a time
    rows += [decoder(ids[j:j + 1], j)[0] for j in range(7, 20)]
    assert (torch.cat(rows).float() - ref).abs().max() < 1e-4


def test_feature_layers_return_the_residual_streams_entering_those_layers():
    """With feature_layers the hidden output is transformers' hidden_states[i] (the input of decoder layer i) of each
    listed layer, concatenated: what an EAGLE-3 head reads; increasing layer indices only."""
    model = tiny_model("llama", layers=4)
    ids = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(0))
    logits, features = Decoder.from_model(model, 16, feature_layers=(1, 3))(ids, 0)
    with torch.no_grad():
        reference = model(ids[None], output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[1][0], reference.hidden_states[3][0]], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference.logits[0], rtol=1e-4, atol=1e-4)
    for bad in ((3, 1), (0, 4)):
        with pytest.raises(DecodeError, match="increasing decoder-layer indices"):
            Decoder.from_model(model, 16, feature_layers=bad)


def test_decoder_shares_the_model_tensors():
    model = family_model("llama")
    decoder = Decoder.from_model(model, max_len=8)
    assert decoder.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert decoder.layers[0].qkv.linears[0] is model.model.layers[0].self_attn.q_proj


def test_sliding_window_matches_transformers(forward):
    model = family_model("mistral", sliding_window=4)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(model, ids)
    decoder = decoder_for(model, 16, forward)
    rows = [decoder(ids[:5], 0)[0]] + [decoder(ids[j:j + 1], j)[0] for j in range(5, 12)]
    assert (torch.cat(rows).float() - ref).abs().max() < 1e-4


# root, then nodes: 0 and 1 children of the root, 2 and 3 of node 0, 4 of node 1, 5 of node 2, 6 of node 4
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4])


def path_to(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


@pytest.mark.parametrize("model_type", ["llama", "gemma", "mistral", "gemma2", "gemma3_text", "phi3"])
def test_tree_forward_equals_separate_sequences(model_type, forward):
    model = family_model(model_type, **({"sliding_window": 7} if model_type == "mistral" else {}))
    g = torch.Generator().manual_seed(3)
    prefix, root = torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (1,), generator=g)
    nodes = torch.randint(0, VOCAB, (len(PARENTS),), generator=g)
    decoder = decoder_for(model, 32, forward)
    decoder(prefix, 0)
    tree_tokens = torch.cat([root, nodes])
    tree_depth = torch.cat([torch.zeros(1, dtype=torch.long), depths(PARENTS)])
    logits, _ = decoder(tree_tokens, 6, tree_depth, ancestor_mask(PARENTS))

    assert (logits[0].float() - hf_logits(model, torch.cat([prefix, root]))[-1]).abs().max() < 1e-4
    for node in range(len(PARENTS)):
        sequence = torch.cat([prefix, root, nodes[path_to(node, PARENTS)]])
        assert (logits[node + 1].float() - hf_logits(model, sequence)[-1]).abs().max() < 1e-4, node


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_compaction_equals_cache_built_from_accepted_sequence(kv_dtype):
    model = family_model("qwen2")
    g = torch.Generator().manual_seed(4)
    prefix, root = torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (1,), generator=g)
    nodes = torch.randint(0, VOCAB, (len(PARENTS),), generator=g)
    accepted = path_to(6, PARENTS)  # [1, 4, 6]: a partial accept away from the first branch
    sequence = torch.cat([prefix, root, nodes[accepted]])

    decoder = Decoder.from_model(model, max_len=32, kv_dtype=kv_dtype)
    decoder(prefix, 0)
    decoder(torch.cat([root, nodes]), 6, torch.cat([torch.zeros(1, dtype=torch.long), depths(PARENTS)]),
            ancestor_mask(PARENTS))
    decoder.cache.keep(6, [0] + [i + 1 for i in accepted])

    direct = Decoder.from_model(model, max_len=32, kv_dtype=kv_dtype)
    direct(sequence, 0)
    n = len(sequence)
    for name in ["k", "v"] + (["k_scale", "v_scale"] if kv_dtype else []):
        got, want = getattr(decoder.cache, name)[:, :, :, :n], getattr(direct.cache, name)[:, :, :, :n]
        if kv_dtype:  # the same float inputs up to summation order: an INT8 code may round the other way
            assert (got.float() - want.float()).abs().max() <= 1 + 1e-5, name
        else:
            assert (got - want).abs().max() < 1e-5, name
    following = torch.tensor([7])
    assert (decoder(following, n)[0] - direct(following, n)[0]).abs().max() < 1e-3


def test_int8_cache_is_close_to_float_cache():
    model = family_model("llama")
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))

    def cached_logits(decoder):
        rows = [decoder(ids[:24], 0)[0]] + [decoder(ids[j:j + 1], j)[0] for j in range(24, 40)]
        return torch.cat(rows).float()

    reference = cached_logits(Decoder.from_model(model, max_len=40))
    dynamic = cached_logits(Decoder.from_model(model, max_len=40, kv_dtype=torch.int8))
    rel = ((dynamic - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.02, rel

    # static per-layer scales from the float cache's absmax (what a calibrated checkpoint would carry)
    float_decoder = Decoder.from_model(model, max_len=40)
    float_decoder(ids, 0)
    scales = torch.stack([float_decoder.cache.k.abs().amax(dim=(1, 2, 3, 4)),
                          float_decoder.cache.v.abs().amax(dim=(1, 2, 3, 4))], dim=1) / 127
    static = cached_logits(Decoder.from_model(model, max_len=40, kv_dtype=torch.int8, kv_scales=scales))
    rel_static = ((static - reference).norm() / reference.norm()).item()
    assert 0 < rel_static < 0.05, rel_static


class _DequantizedLinear(nn.Module):
    """Not an nn.Linear: a module with only forward(x), as a runtime QuantLinear is to the decoder."""

    def __init__(self, linear):
        super().__init__()
        from toolkit.quant.primitives import quantize_rtn

        self.register_buffer("W", quantize_rtn(linear.weight.detach(), 4, 32, True).dequantize())
        self.bias = linear.bias

    def forward(self, x):
        return nn.functional.linear(x, self.W.to(x.dtype), self.bias)


def test_quantized_modules_just_work():
    model = family_model("qwen2")
    for layer in model.model.layers:
        for parent, name in [(layer.self_attn, "q_proj"), (layer.self_attn, "v_proj"), (layer.mlp, "down_proj")]:
            setattr(parent, name, _DequantizedLinear(getattr(parent, name)))
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(6))
    logits, _ = Decoder.from_model(model, max_len=16)(ids, 0)
    assert (logits.float() - hf_logits(model, ids)).abs().max() < 1e-4


def test_unsupported_models_are_refused_with_the_fix():
    model = tiny_model("llama", vocab=VOCAB)
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(DecodeError, match="'dynamic' is not supported.*default, linear, llama3, yarn"):
        Decoder.from_model(model, max_len=8)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model.config.model_type = "gpt2"
    with pytest.raises(DecodeError, match="does not support model_type 'gpt2'"):
        Decoder.from_model(model, max_len=8)


def test_overflowing_the_cache_names_the_fix():
    decoder = Decoder.from_model(tiny_model("llama", vocab=VOCAB), max_len=4)
    with pytest.raises(DecodeError, match=r"max_len>=6"):
        decoder(torch.arange(6), 0)


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from toolkit.models import load_model

    model = load_model("smollm2-135m")
    ids = torch.randint(0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(model, ids)
    decoder = Decoder.from_model(model, max_len=64)
    rows = [decoder(ids[:40], 0)[0]] + [decoder(ids[j:j + 1], j)[0] for j in range(40, 48)]
    diff = (torch.cat(rows).float() - ref).abs().max().item()
    print(f"SmolLM2-135M: max |logits - transformers| = {diff:.2e} (logit range {ref.abs().max().item():.1f})")
    assert diff < 1e-3


def test_rescored_head_is_exact_on_each_rows_top_logits_and_keeps_the_argmax():
    from toolkit.decode.lm_head import RescoredHead

    generator = torch.Generator().manual_seed(7)
    head = nn.Linear(64, 5000, bias=True)
    nn.init.normal_(head.weight, std=0.5, generator=generator)
    nn.init.normal_(head.bias, std=0.5, generator=generator)
    hidden = torch.randn(40, 64, generator=generator)
    for rows in (hidden, hidden[:1], hidden[0]):  # a batch; one row, as [1, D] and [D] (the decode step's mv)
        exact, fast = head(rows), RescoredHead(head, top=16)(rows)
        assert fast.shape == exact.shape
        top = exact.topk(8, dim=-1).indices
        assert torch.allclose(fast.gather(-1, top), exact.gather(-1, top), atol=1e-5)  # recomputed in float32
        assert torch.equal(fast.argmax(-1), exact.argmax(-1))
        rest = (fast - exact).abs().max()
        assert 0 < rest < 0.05 * exact.abs().max()  # everything else is the bf16 product's


def test_fast_head_decodes_the_same_greedy_tokens():
    from toolkit.decode import generate

    model = spread(family_model("llama"))
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8)).tolist()
    exact, _ = generate(Decoder.from_model(model, 40), ids, 32)
    fast_decoder = Decoder.from_model(model, 40, fast_head=True)
    fast, _ = generate(fast_decoder, ids, 32)
    assert type(fast_decoder.lm_head).__name__ == "RescoredHead" and torch.equal(fast, exact)


def test_int4_rows_decode_alike_alone_or_in_a_block():
    """Speculative verification is lossless only if a token's hidden state is the same bits whether it is decoded
    alone (greedy) or among the rows of a block (prefill, verification). The int4 op rounds its input to bf16, so
    float32 attention's row-count-dependent reductions (~1e-7) became different tokens on an AVX2 CPU (SmolLM2 W4
    hidden states 0.4 apart; tiny random models do not show it)."""
    from toolkit.models import load_model

    model = int4_linears(load_model("smollm2-135m"))
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(11))
    alone = Decoder.from_model(model, max_len=48)
    one_by_one = torch.cat([alone(ids[t:t + 1], t)[1] for t in range(len(ids))])
    blocks = Decoder.from_model(model, max_len=48)
    in_blocks = torch.cat([blocks(ids[:17], 0)[1], blocks(ids[17:26], 17)[1], blocks(ids[26:], 26)[1]])
    assert torch.equal(one_by_one, in_blocks)


def test_prepare_packs_every_int4_linear_once_and_decodes_the_same_tokens(monkeypatch):
    """``Decoder.prepare`` does the int4 packing up front (so a decode's timing leaves it out): afterwards a forward
    packs nothing more, and the greedy tokens equal those of a decoder that packed lazily."""
    from toolkit.decode import generate
    from toolkit.runtime import cpu_int4
    from toolkit.runtime.quant_linear import QuantLinear

    model = int4_linears(spread(family_model("llama")))
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(8)).tolist()
    lazy, _ = generate(Decoder.from_model(model, 40), ids, 16)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module._int4 = None
    eager = Decoder.from_model(model, 40)
    packed = []
    original = cpu_int4.prepare_int4_cpu
    monkeypatch.setattr(cpu_int4, "prepare_int4_cpu", lambda *a, **k: packed.append(a[0].shape) or original(*a, **k))
    eager.prepare()
    layers = len(model.model.layers)
    assert len(packed) == 4 * layers  # fused q/k/v, o_proj, fused gate/up, down_proj per layer
    before = len(packed)
    tokens, _ = generate(eager, ids, 16)
    assert len(packed) == before and torch.equal(tokens, lazy)
