import pytest
import torch
from conftest import tiny_model

from toolkit.engine.session import LayerSession, capture_layer_inputs
from toolkit.models import ModelError, decoder_layers, layer_linears, load_model, load_tokenizer
from toolkit.quant.configs import RTNConfig

LLAMA_GROUPS = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"],
    ["mlp.down_proj"],
]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma"])
def test_layers_and_linears_are_discovered(model_type):
    model = tiny_model(model_type, vocab=128)
    layers = decoder_layers(model)
    assert len(layers) == 2
    linears = layer_linears(layers[0])
    assert sorted(linears) == sorted(name for group in LLAMA_GROUPS for name in group)
    inputs = capture_layer_inputs(model, torch.randint(0, 128, (2, 8)), batch_size=1)
    assert len(inputs.hidden) == 2 and inputs.hidden[0].shape == (1, 8, 64)
    session = LayerSession(0, layers[0], inputs, RTNConfig(group_size=32), linears)
    assert session.trace_input_groups() == LLAMA_GROUPS
    # the captured inputs reproduce the model's own layer output
    expected = model(torch.randint(0, 128, (1, 8)), output_hidden_states=True)
    assert torch.isfinite(session.forward()[0]).all() and expected.hidden_states[1].shape == (1, 8, 64)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ModelError, match=r"unsupported architecture 'gpt2'.*llama"):
        decoder_layers(model)


def test_unsupported_architecture_refused_before_loading_weights(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("./no/such/dir", "does not exist"),
        ("/no/such/model.gguf", "does not exist"),
        ("just-a-name", "neither an existing path"),
    ],
)
def test_bad_specs_get_clear_errors(spec, message):
    with pytest.raises(ModelError, match=message):
        load_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_hub_id_offline_fails_with_a_clear_message():
    # HF_HUB_OFFLINE=1 and a dead local endpoint (conftest): the real from_pretrained path runs, nothing leaves.
    with pytest.raises(ModelError, match="Hugging Face Hub did not serve it"):
        load_tokenizer("some-org/some-model")


def test_local_directory_loads(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir))
    assert model.config.model_type == "llama" and not model.training


@pytest.mark.slow
def test_a_gguf_config_is_parsed_once_per_process(monkeypatch):
    """empty_model, then load_model, read the embedded GGUF's config once (each parse of the file takes seconds);
    each caller gets its own copy."""
    import transformers

    from toolkit import models

    models._gguf_config.cache_clear()
    parses = []
    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: parses.append(k.get("gguf_file")) or real(*a, **k))
    skeleton = models.empty_model("smollm2-135m")
    model = load_model("smollm2-135m")
    assert parses == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert model.config is not skeleton.config
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (30, 576) == (
        skeleton.config.num_hidden_layers, skeleton.config.hidden_size)
