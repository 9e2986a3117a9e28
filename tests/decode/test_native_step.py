"""The decoder's C++ step (``toolkit.runtime.decode_step``) against its torch forward, the reference: every family,
prefill, single tokens, trees, EAGLE-3 feature layers; a row's bits alone and in a block; where it runs."""

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import int4_linears, perturb_biases_and_norms, tiny_config
from toolkit.architectures import supporting
from toolkit.decode import Decoder
from toolkit.decode.tree import ancestor_mask, depths
from toolkit.runtime import decode_step, native

FAMILIES = supporting("decode")
VOCAB = 256
RUNS_HERE = not native.missing_cpu_flags(decode_step.BUILD)
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4])  # a tree of 7 nodes below the root (as tests/decode/test_model.py)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not RUNS_HERE, reason="this CPU lacks AVX2 and FMA")]


def family_model(model_type, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=VOCAB, **overrides)).eval()
    perturb_biases_and_norms(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def both(model, max_len=40, **kwargs):
    """Two decoders of ``model``: the C++ step and the torch forward."""
    fast, reference = Decoder.from_model(model, max_len, **kwargs), Decoder.from_model(model, max_len, **kwargs)
    reference.native_step = None
    assert fast.native_step is not None
    return fast, reference


ATOL = 2e-5  # of the largest magnitude compared


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL * want.abs().max().item())


def test_it_runs_wherever_the_cpu_allows_and_only_for_float32_caches():
    """The build must succeed where the CPU has AVX2 and FMA (a failed build fails this test, it is not skipped);
    bfloat16 models and INT8 caches keep the torch forward."""
    model = family_model("llama")
    assert Decoder.from_model(model, 8).native_step is not None
    assert Decoder.from_model(model, 8, kv_dtype=torch.int8).native_step is None
    assert Decoder.from_model(model.to(torch.bfloat16), 8).native_step is None
    odd_heads = family_model("llama", head_dim=12)  # the C++ attention reads heads in steps of 8 floats
    odd = Decoder.from_model(odd_heads, 8)
    assert odd.native_step is None and odd(torch.arange(3), 0)[0].shape == (3, VOCAB)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_equals_the_torch_forward(model_type):
    """Prefill, then single tokens, then a speculative tree: logits, hidden states and the KV cache agree."""
    model = family_model(model_type, **({"sliding_window": 5} if model_type in ("mistral", "mixtral") else {}))
    fast, reference = both(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (16,), generator=g)
    nodes = torch.randint(0, VOCAB, (1 + len(PARENTS),), generator=g)
    tree = torch.cat([torch.zeros(1, dtype=torch.long), depths(PARENTS)]), ancestor_mask(PARENTS)
    calls = [(ids[:9], 0), *((ids[j:j + 1], j) for j in range(9, 16)), (nodes, 16, *tree)]
    for args in calls:
        (logits, hidden), (want_logits, want_hidden) = fast(*args), reference(*args)
        assert_close(logits, want_logits)
        assert_close(hidden, want_hidden)
    end = 16 + len(nodes)
    assert_close(fast.cache.k[:, :, :, :end], reference.cache.k[:, :, :, :end])
    assert_close(fast.cache.v[:, :, :, :end], reference.cache.v[:, :, :, :end])


def test_feature_layers_equal_the_torch_forward():
    model = family_model("llama", layers=4)
    fast, reference = both(model, feature_layers=(0, 2, 3))
    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(2))
    (logits, features), (want_logits, want_features) = fast(ids, 0), reference(ids, 0)
    assert features.shape == (11, 3 * model.config.hidden_size)
    assert_close(features, want_features)
    assert_close(logits, want_logits)


def test_a_row_gets_the_same_bits_alone_or_in_a_block():
    """Float32 attention row by row: one token at a time, blocks of 5, 4 and 3, and a tree's path all give each token
    the same bits, so speculative verification is lossless without the torch forward's float64 attention (int4
    linears, whose rows are computed alone; float ones are not, torch's gemv and gemm sum in different orders)."""
    model = int4_linears(family_model("qwen3"))
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    alone = Decoder.from_model(model, 16)
    one_by_one = torch.cat([alone(ids[t:t + 1], t)[1] for t in range(12)])
    blocks = Decoder.from_model(model, 16)
    in_blocks = torch.cat([blocks(ids[:5], 0)[1], blocks(ids[5:9], 5)[1], blocks(ids[9:], 9)[1]])
    assert torch.equal(one_by_one, in_blocks)
    # the same three tokens as a chain inside a tree whose other branch is masked off
    tree = Decoder.from_model(model, 16)
    tree(ids[:9], 0)
    parents = torch.tensor([-1, -1, 0])  # below the root ids[9]: ids[10], a sibling of it, ids[11] under ids[10]
    tokens = torch.stack([ids[9], ids[10], torch.tensor(5), ids[11]])
    depth = torch.cat([torch.zeros(1, dtype=torch.long), depths(parents)])
    hidden = tree(tokens, 9, depth, ancestor_mask(parents))[1]
    assert torch.equal(hidden[[0, 1, 3]], one_by_one[9:])


def test_a_wrong_step_is_caught(monkeypatch):
    """The comparison sees a step that reads the wrong key/value head (GQA) or drops the norm offset."""
    model = family_model("gemma")
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    _, reference = both(model)
    want = reference(ids, 0)[0]

    class Wrong:
        def __init__(self, ops, **changes):
            self.ops, self.changes = ops, changes

        def __getattr__(self, name):
            return getattr(self.ops, name)

        def rms_norm(self, x, w, eps, offset):
            return self.ops.rms_norm(x, w, eps, self.changes.get("offset", offset))

        def add_rms_norm(self, x, delta, w, eps, offset):
            return self.ops.add_rms_norm(x, delta, w, eps, self.changes.get("offset", offset))

        def attention(self, q, k, v, start, mask, scale, softcap):
            if self.changes.get("swap_kv"):
                k, v = v, k
            return self.ops.attention(q, k, v, start, mask, scale, softcap)

    for changes in ({"offset": 0.0}, {"swap_kv": True}):
        fast = Decoder.from_model(model, 40)
        fast.native_step = Wrong(fast.native_step, **changes)
        assert (fast(ids, 0)[0] - want).abs().max() > 100 * ATOL * want.abs().max(), changes  # far outside


def test_shapes_it_cannot_take_are_refused():
    ops = decode_step.load()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="w float32"):
        ops.rms_norm(x, torch.ones(4), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-6, 0.0)
    cache = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="room for slots"):
        ops.rope_and_cache(torch.zeros(1, 24), torch.zeros(1, 8), torch.zeros(1, 8), cache, cache.clone(), 4, 1, 1,
                           None, None, 1e-6, 0.0)


def test_the_source_is_installed_with_the_package():
    assert decode_step.BUILD.path.is_file() and decode_step.BUILD.path.parent == Path(native.__file__).parent
    assert isinstance(decode_step.load(), type(nn))  # a module


def test_a_long_prompt_prefills_through_the_torch_forward_and_decoding_stays_lossless(monkeypatch):
    """A prompt of ``torch_prefill_rows`` tokens or more at slot 0 runs the torch forward (the C++ attention's cost
    grows with the square of a block's rows); every later forward, however many rows (a chain, a verification
    tree), runs the C++ step, whose rows are the same bits alone or in a block. Greedy and speculative decoding both
    prefill the prompt by that one call, so they still give the same tokens."""
    from toolkit.decode import ModelDrafter, generate, speculative_generate

    monkeypatch.setattr(Decoder, "torch_prefill_rows", 8)
    model = int4_linears(family_model("qwen3"))
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5))
    decoder, reference = both(model, 48)
    ran = []
    for name in ("_torch_layers", "_native_layers"):
        monkeypatch.setattr(decoder, name, lambda *args, _run=getattr(decoder, name), _name=name:
                            ran.append(_name) or _run(*args))
    decoder(ids[:7], 0)
    assert torch.equal(decoder(ids[:8], 0)[1], reference(ids[:8], 0)[1])  # the torch forward itself
    decoder(ids[8:18], 8)
    decoder(ids[18:], 18, torch.tensor([0, 1]), torch.ones(2, 2, dtype=torch.bool).tril())
    assert ran == ["_native_layers", "_torch_layers", "_native_layers", "_native_layers"]

    ran.clear()
    prompt = ids[:12]
    plain, _ = generate(decoder, prompt, 16)
    drafter = ModelDrafter(Decoder.from_model(family_model("llama"), 48), k=9)  # verification blocks of 10 rows
    speculative, stats = speculative_generate(decoder, drafter, prompt, 16)
    assert torch.equal(speculative, plain)
    assert ran.count("_torch_layers") == 2 and ran[0] == "_torch_layers"  # each run's prefill, nothing else
    assert ran[16] == "_torch_layers" and sum(stats.accepted) < 9 * len(stats.accepted)  # some drafts rejected
