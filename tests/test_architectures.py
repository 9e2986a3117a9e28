"""The architecture table and its three readers (models, decode, EAGLE heads) agree, on a tiny model of every family."""

import pytest
import torch

from toolkit.architectures import FAMILIES, UnsupportedFamily, family, supporting
from toolkit.decode import DecodeError, Decoder
from toolkit.heads.eagle import EagleHead
from toolkit.models import ModelError, arch_spec, decoder_layers

pytestmark = pytest.mark.usefixtures("one_thread")


def family_model(model_type: str):
    """A seeded random tiny causal LM built from the transformers config class of ``model_type`` (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                  max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_coverage_is_what_compound_supports():
    assert supporting() == ("gemma", "gemma2", "llama", "mistral", "qwen2", "qwen3")
    assert supporting("decode") == ("gemma", "llama", "mistral", "qwen2", "qwen3")
    assert supporting("eagle") == ("llama", "mistral", "qwen2", "qwen3")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_reader_follows_the_table(model_type):
    model = family_model(model_type)
    entry = FAMILIES[model_type]
    assert arch_spec(model) is entry
    layer = decoder_layers(model)[0]
    assert decoder_layers(model) is model.get_submodule(entry.layers)
    for prev, names in entry.awq_groups:
        for name in (prev, *names):
            layer.get_submodule(name)  # raises when a scaling group names no module of the layer
    assert hasattr(layer.self_attn, "q_norm") == entry.qk_norm
    if entry.decode:
        logits, _ = Decoder.from_model(model, max_len=8)(torch.arange(4), 0)
        assert logits.shape == (4, 128) and torch.isfinite(logits).all()
    else:
        with pytest.raises(DecodeError, match=f"does not support model_type '{model_type}'; it decodes gemma, llama"):
            Decoder.from_model(model, max_len=8)
    if entry.eagle:
        assert EagleHead.from_target(model, "eagle").config.hidden_size == 64
    else:
        with pytest.raises(ValueError, match=f"model_type '{model_type}' are not supported; supported: llama, "
                                             "mistral, qwen2, qwen3$"):
            EagleHead.from_target(model, "eagle")


def test_an_unknown_family_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedFamily, match=r"'gpt2' is not supported; supported: gemma, gemma2, llama, "
                                                r"mistral, qwen2, qwen3$"):
        family("gpt2")
    with pytest.raises(UnsupportedFamily, match=r"'gemma2' is not supported for decode; supported: gemma, llama"):
        family("gemma2", "decode")
    with pytest.raises(ValueError, match="unknown capability 'train'; one of decode, eagle"):
        supporting("train")

    model = family_model("llama")
    model.config.model_type = "gpt2"
    with pytest.raises(ModelError, match=r"unsupported architecture 'gpt2': compound quantizes gemma, gemma2, llama"):
        decoder_layers(model)
    with pytest.raises(DecodeError, match="does not support model_type 'gpt2'"):
        Decoder.from_model(model, max_len=8)
    with pytest.raises(ValueError, match="EAGLE heads for model_type 'gpt2' are not supported"):
        EagleHead.from_target(model, "eagle")
