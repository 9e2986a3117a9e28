"""GGUF export of Gemma 3 (``gemma3_text`` → llama.cpp's ``gemma3``) on tiny random models: the tensors written are
the names llama.cpp's own gguf-py declares for the architecture, norm weights carry Gemma's (1 + w), q/k rows keep
Hugging Face's order (llama.cpp's gemma3 rotates halves), the keys llama.cpp reads for what it does not fix, and what
llama.cpp fixes for the architecture is refused when a config differs, before any weight is read. llama.cpp itself
scores these files in tests/integration/test_llamacpp_gemma3.py."""

import gguf
import pytest
import torch
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from typer.testing import CliRunner

from conftest import GEMMA3_GGUF, byte_tokenizer, perturb_biases_and_norms, refused, tiny_model
from toolkit.cli import app
from toolkit.formats.gguf_blocks import dequantize
from toolkit.formats.scheme import FormatError
from toolkit.gguf_export import export_gguf
from toolkit.runtime.load import load_quantized
from toolkit.runtime.quant_linear import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = GEMMA3_GGUF["layers"]


def gemma3_dir(path, **overrides):
    model = perturb_biases_and_norms(tiny_model("gemma3_text", **{**GEMMA3_GGUF, "vocab": 256, **overrides}))
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path, model


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_float_export_writes_llama_cpps_gemma3_tensors_and_keys(tmp_path):
    directory, model = gemma3_dir(tmp_path / "tiny")
    path = export_gguf(str(directory), tmp_path / "tiny-F32.gguf", outtype="F32")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    declared = {TENSOR_NAMES[t].format(bid=i) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.GEMMA3]
                for i in range(LAYERS)}
    assert set(tensors) == declared - {"output.weight"}  # tied: llama.cpp reads token_embd as the output
    state = model.state_dict()
    for hf, name in (("model.layers.5.pre_feedforward_layernorm", "blk.5.ffn_norm"),
                     ("model.layers.5.post_attention_layernorm", "blk.5.post_attention_norm"),
                     ("model.layers.0.post_feedforward_layernorm", "blk.0.post_ffw_norm"),
                     ("model.layers.0.self_attn.q_norm", "blk.0.attn_q_norm"), ("model.norm", "output_norm")):
        assert torch.equal(torch.tensor(tensors[f"{name}.weight"].data), state[f"{hf}.weight"] + 1), name
    for hf, name in (("model.layers.2.self_attn.q_proj", "blk.2.attn_q"), ("model.embed_tokens", "token_embd")):
        assert torch.equal(torch.tensor(tensors[f"{name}.weight"].data), state[f"{hf}.weight"]), name  # unpermuted
    value = {key: field.contents() for key, field in reader.fields.items()}
    config = model.config
    assert value["general.architecture"] == "gemma3"
    assert value["gemma3.attention.sliding_window"] == config.sliding_window
    assert value["gemma3.attention.key_length"] == config.head_dim and value["gemma3.block_count"] == LAYERS
    assert value["gemma3.final_logit_softcapping"] == 5.0
    assert value["gemma3.rope.freq_base"] == config.rope_parameters["full_attention"]["rope_theta"]
    assert value["gemma3.rope.scaling.type"] == "linear" and value["gemma3.rope.scaling.factor"] == 4.0


def test_quantized_linears_are_the_codes_compound_runs_in_huggingface_row_order(tmp_path):
    directory, _ = gemma3_dir(tmp_path / "tiny")
    out = tmp_path / "w4"
    result = CliRunner().invoke(app, ["quantize", "--model", str(directory), "--method", "rtn", "--group-size", "32",
                                      "--sym", "--gguf", "--dtype", "float32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    tensors = _tensors(out / "w4-Q4_0.gguf")
    ours, _ = load_quantized(out, backend="reference")
    for name, module in ours.named_modules():
        if isinstance(module, QuantLinear) and name.startswith("model.layers.1."):
            stem = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[name.rpartition(".")[2]]
            t = tensors[f"blk.1.{stem}.weight"]
            W = module.dequantized_weight()
            assert torch.equal(dequantize("Q4_0", torch.tensor(t.data), tuple(W.shape)), W), name


@pytest.mark.parametrize("overrides,message", [
    (dict(layer_types=["sliding_attention", "full_attention"] * 3), "every layer but each 6th"),
    (dict(query_pre_attn_scalar=32), "scales attention scores by 16"),
    (dict(attn_logit_softcapping=50.0), "does not soft-cap attention scores"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "base 10000"),
])
def test_what_llama_cpp_fixes_for_gemma3_is_refused_before_any_weight_is_read(tmp_path, overrides, message):
    directory, _ = gemma3_dir(tmp_path / "tiny", **overrides)
    with pytest.raises(FormatError, match=message):
        export_gguf(str(directory), tmp_path / "t.gguf")
    result = CliRunner().invoke(app, ["quantize", "--model", str(directory), "--method", "rtn", "--group-size", "32",
                                      "--gguf", "-o", str(tmp_path / "w4")])
    refused(result, message)
    assert not (tmp_path / "w4").exists() and not (tmp_path / "t.gguf").exists()


def test_a_sentencepiece_tokenizer_without_its_source_gguf_is_refused(tmp_path, gemma_tokenizer):
    directory, _ = gemma3_dir(tmp_path / "tiny")
    gemma_tokenizer.save_pretrained(directory)
    with pytest.raises(FormatError, match="SentencePiece .* has no source GGUF"):
        export_gguf(str(directory), tmp_path / "t.gguf")
