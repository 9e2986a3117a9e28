"""The architecture table and its three readers (models, decode, EAGLE heads) agree, on a tiny model of every family;
the README lists what it declares, and the CLI refuses a family outside it."""

from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, refused, tiny_config
from toolkit.architectures import FAMILIES, UnsupportedFamily, family, supporting
from toolkit.decode import DecodeError, Decoder
from toolkit.experts import unfuse_experts
from toolkit.heads.eagle import EagleHead
from toolkit.methods.awq import expand_groups
from toolkit.models import ModelError, arch_spec, decoder_layers, layer_linears

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def family_model(model_type: str):
    """A seeded random tiny causal LM built from the transformers config class of ``model_type`` (no download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=128)).eval()


def _has(module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def test_coverage_is_what_compound_supports():
    every = ("gemma", "gemma2", "gemma3_text", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3",
             "qwen3_moe")
    assert supporting() == every
    assert supporting("decode") == every
    assert supporting("eagle") == ("gemma3_text", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                                   "qwen3_moe")
    assert FAMILIES["gemma3_text"].eagle == ("eagle3",)  # EAGLE-1's fc would read Gemma's unscaled embedding
    assert supporting("gguf") == ("gemma3_text", "llama")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_reader_follows_the_table(model_type):
    model = family_model(model_type)
    entry = FAMILIES[model_type]
    assert arch_spec(model) is entry
    layer = decoder_layers(model)[0]
    assert decoder_layers(model) is model.get_submodule(entry.layers)
    layers = unfuse_experts(family_model(model_type)).model.layers
    linears = {name for layer in layers for name in layer_linears(layer)}
    for prev, names in expand_groups(entry.awq_groups, dict.fromkeys(linears)):
        # every scaling group names modules of some layer (a MoE family's dense groups: its dense layers)
        assert any(all(_has(layer, name) for name in (prev, *names)) for layer in layers), (prev, names)
    unfused = unfuse_experts(family_model(model_type)).model.layers[0]
    # q/k/v and gate/up, separate or fused, and with o_proj and down_proj every linear of the layer; a MoE layer's
    # MLP is its experts' projections (one linear each once unfused), a shared expert's and its gate
    if entry.experts is None:
        assert set(layer_linears(layer)) == {*entry.qkv, *entry.gate_up, "self_attn.o_proj", "mlp.down_proj"}
    else:
        experts = {f"mlp.experts.{e}.{name}" for e in range(4) for name in entry.experts.projections}
        shared = ({f"{entry.experts.shared}.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
                  | {"mlp.shared_expert_gate"} if entry.experts.shared else set())
        assert set(layer_linears(layer)) == {*entry.qkv, "self_attn.o_proj"} | shared
        assert set(layer_linears(unfused)) == {*entry.qkv, "self_attn.o_proj"} | shared | experts
    assert hasattr(layer.self_attn, "q_norm") == entry.qk_norm
    assert hasattr(layer, "post_feedforward_layernorm") == entry.post_norms
    layer.get_submodule(entry.mlp_norm)
    assert hasattr(model.model.rotary_emb, "inv_freq") != entry.rope_by_layer_type
    if entry.decode:
        logits, _ = Decoder.from_model(model, max_len=8)(torch.arange(4), 0)
        assert logits.shape == (4, 128) and torch.isfinite(logits).all()
    for kind, takers in (("eagle", "llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"),
                         ("eagle3", "gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe")):
        if kind in entry.eagle:
            assert EagleHead.from_target(model, kind).config.hidden_size == 64
        else:
            with pytest.raises(ValueError, match=f"model_type '{model_type}' are not supported; supported: {takers}$"):
                EagleHead.from_target(model, kind)


def test_an_unknown_family_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedFamily, match=r"'gpt2' is not supported; supported: gemma, gemma2, gemma3_text, "
                                                r"llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe$"):
        family("gpt2")
    with pytest.raises(UnsupportedFamily, match=r"'gemma2' is not supported for eagle; supported: gemma3_text, llama"):
        family("gemma2", "eagle")
    with pytest.raises(ValueError, match="unknown capability 'train'; one of decode, eagle"):
        supporting("train")

    model = family_model("llama")
    model.config.model_type = "gpt2"
    with pytest.raises(ModelError, match=r"unsupported architecture 'gpt2': compound quantizes gemma, gemma2, "
                                         r"gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, "
                                         r"qwen3_moe$"):
        decoder_layers(model)
    with pytest.raises(DecodeError, match="does not support model_type 'gpt2'; it decodes gemma, gemma2"):
        Decoder.from_model(model, max_len=8)
    with pytest.raises(ValueError, match=r"EAGLE heads \(eagle\) for model_type 'gpt2' are not supported"):
        EagleHead.from_target(model, "eagle")


def test_the_cli_refuses_an_unknown_family_naming_the_supported_ones(tmp_path, runs):
    from transformers import GPT2Config, GPT2LMHeadModel
    from typer.testing import CliRunner

    from toolkit.cli import app

    model = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256)).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    result = CliRunner().invoke(app, ["quantize", "--model", str(model), "--output", str(runs / "q")])
    refused(result, "unsupported architecture 'gpt2'", ", ".join(supporting()))
    assert list(runs.iterdir()) == []


README_COLUMNS = ("model_type", "quantize", "formats", "decode", "heads")


def readme_families() -> dict[str, dict[str, str]]:
    """The rows of the README's table of supported families: model_type → {column: cell}."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| model_type | quantize | formats | decode | heads | vLLM CPU | differs from Llama |")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(README_COLUMNS, cells))
    return rows


def test_the_readme_lists_what_the_table_declares():
    from toolkit.formats import FORMATS
    from toolkit.quant.configs import METHODS

    rows = readme_families()
    assert tuple(rows) == supporting()
    for name, row in rows.items():
        entry = FAMILIES[name]
        assert row["quantize"] == ", ".join(METHODS), name
        assert row["formats"] == ", ".join(n for n, module in FORMATS.items() if module.CHECKPOINT or entry.gguf), name
        assert row["decode"] == ("yes" if entry.decode else "no"), name
        heads = (["medusa"] if entry.decode else []) + list(entry.eagle)
        assert row["heads"] == (", ".join(heads) or "none"), name
